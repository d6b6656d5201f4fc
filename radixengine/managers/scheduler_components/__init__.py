"""The scheduler's components: each owns its state and is handed what it needs when built.

intake → admission (prefill) / running-batch updater (decode) → [forward] → batch result
processor → output streamer; the metrics reporter and the new-token-ratio tracker are read and fed
by the others. `managers/scheduler.py` is the loop and the wiring."""
