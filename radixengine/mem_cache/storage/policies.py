"""The hierarchical cache's policy names (SGLang's), importable without torch."""

HICACHE_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
HICACHE_STORAGE_BACKENDS = ("file",)
# SGLang's environment variables of the file backend.
FILE_BACKEND_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
FILE_BACKEND_MAX_SIZE_ENV = "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"
DEFAULT_FILE_BACKEND_DIR = "/tmp/hicache"
# The file backend's folder bound when neither the flag nor the variable sets one: about 190k
# tokens of an fp16 1.7B model (~44 KB per token); 0 set explicitly means no bound.
DEFAULT_FILE_BACKEND_MAX_BYTES = 8 << 30
