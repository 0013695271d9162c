"""What ``save_model()`` writes for what moe4bit changed, and the state-dict hooks that keep it so.

moe4bit changes no saved value. It re-homes tensors into shared buffers (each per-expert ``Linear4bit``'s packed
bytes and absmax in one stack per projection; each per-expert LoRA factor in one ``[E, ...]`` stack), which
safetensors and ``save_pretrained`` refuse as shared storage: :func:`clone_shared_on_save` hands out private copies
in the state dict. ``quantize_experts_4bit`` stacks save in bitsandbytes' packed form; ``_qstate.load_pre_hook`` reads
it back.
"""

from __future__ import annotations

import torch
from torch import nn

from ._stacks import Record


DECLARATION = (
    "unchanged keys and values: quantize_experts_4bit's stacks save packed with their quantization state "
    "(load_state_dict into a model quantized the same way); per-expert Linear4bit weights and per-expert LoRA "
    "factors the grouped path consolidates stay each expert's own parameter (views of one buffer, copied out on "
    "save); expert LoRA adapters save with PEFT's save_pretrained"
)


def clone_shared_on_save(module: nn.Module, buffers: list[torch.Tensor], record: Record) -> None:
    """Tensors of ``module``'s state dict that live in one of ``buffers`` are handed out as private copies (loading
    still copies into the shared buffers); the hook's removal goes to ``record``."""
    shared = {t.untyped_storage().data_ptr() for t in buffers}

    def hook(mod: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for key, value in list(state_dict.items()):
            if key.startswith(prefix) and isinstance(value, torch.Tensor):
                if value.untyped_storage().data_ptr() in shared:
                    state_dict[key] = value.detach().clone()

    record(module.register_state_dict_post_hook(hook).remove)
