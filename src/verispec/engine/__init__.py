"""Continuous batching with speculative decoding: a block manager (paged KV), a scheduler, one batched step."""

from .block_manager import BlockManager, block_hash
from .scheduler import ScheduledChunk, Scheduler, Sequence, SequenceStatus

__all__ = ["BlockManager", "block_hash", "ScheduledChunk", "Scheduler", "Sequence", "SequenceStatus"]
