"""The project's own paged model implementations, keyed by the `architectures` name in config.json."""
from pagedserve.services.worker.models.llama import LlamaForCausalLM
from pagedserve.services.worker.models.opt import OPTForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}
