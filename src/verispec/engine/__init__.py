"""Continuous batching with speculative decoding: a block manager (paged KV), a scheduler, one batched step."""

from .block_manager import BlockManager, block_hash
from .engine import Capture, Engine, Request
from .scheduler import ScheduledChunk, Scheduler, Sequence, SequenceStatus

__all__ = ["BlockManager", "block_hash", "Capture", "Engine", "Request", "ScheduledChunk", "Scheduler", "Sequence",
           "SequenceStatus"]
