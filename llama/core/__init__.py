"""The decode core: requests, the scheduler's typed plans, the runner, the one decode loop, the engine, the KV cache
and what reuses it (prefixes, chat sessions). Nothing here knows a checkpoint format."""
