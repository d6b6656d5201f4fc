"""Where a CPU stream runs its work (`streams.new_stream`, `--cpu-forward-stream`). Kept apart from
`streams` (which imports torch) so that ServerArgs can name the choices and stay light."""

CPU_STREAM_LAYOUTS = ("auto", "thread", "inline")
