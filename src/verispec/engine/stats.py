"""What one request's generation did: tokens, target forwards, time, and per-position acceptance of its drafts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    prefill_s: float = 0.0
    target_s: float = 0.0  # all target forwards, prefill included
    draft_s: float = 0.0  # time inside drafter.propose
    wall_s: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    reached: list[int] = field(default_factory=list)  # [K] (sized by the loop): rounds that judged position i
    accepted_at: list[int] = field(default_factory=list)  # [K]: rounds in which position i was accepted
    drafters: dict[str, list[int]] = field(default_factory=dict)  # [rounds, drafted, accepted] per delegate (every
    # delegate of a drafter that has them, auto's: 0 rounds where plain steps or another delegate won)

    def record_round(self, num_drafted: int, num_accepted: int) -> None:
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        for i in range(min(num_accepted + 1, num_drafted)):  # position i is judged iff all before it passed
            self.reached[i] += 1
            self.accepted_at[i] += i < num_accepted

    def as_dict(self) -> dict:
        decode_tokens = max(self.new_tokens - 1, 0)  # the first token comes out of the prefill
        out = {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted_length": self.new_tokens / self.target_forwards if self.target_forwards else 0.0,
            "prefill_s": round(self.prefill_s, 6),
            "target_s": round(self.target_s, 6),
            "wall_s": round(self.wall_s, 6),
            "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "decode_ms_per_token": 1e3 * (self.wall_s - self.prefill_s) / decode_tokens if decode_tokens else 0.0,
        }
        if self.reached:
            out.update(
                draft_s=round(self.draft_s, 6),
                drafted_tokens=self.drafted_tokens,
                accepted_tokens=self.accepted_tokens,
                acceptance_rate=self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
                # P(position i accepted | positions before it accepted); None where never reached
                per_position_acceptance=[a / r if r else None for a, r in zip(self.accepted_at, self.reached)],
                per_position_reached=list(self.reached),
            )
        if self.drafters:
            out["drafter_rounds"] = {k: r for k, (r, _, _) in self.drafters.items()}
            out["drafter_tokens"] = {k: {"drafted": d, "accepted": a} for k, (_, d, a) in self.drafters.items()}
        return out
