"""Tiny, seeded models and a byte-level BPE tokenizer trained on text that ships with Python.

Used by the demo, the tests and the benchmarks' smoke mode: nothing is downloaded from a hub.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
import transformers


FAMILIES = ("llama", "gpt2", "gemma2", "qwen2", "mistral", "phi3", "gpt_neox", "qwen3_moe", "gpt_oss")


def corpus_texts(min_chars: int = 200) -> list[str]:
    """Paragraphs of Python's own documentation (``pydoc_data.topics``), about 0.45 MB of English and code."""
    from pydoc_data.topics import topics

    paragraphs: list[str] = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(block.split())
            if len(text) >= min_chars:
                paragraphs.append(text)
    return paragraphs


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int = 2048) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in a few seconds on :func:`corpus_texts`, with pad/eos/bos tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|endoftext|>", "<|bos|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>", bos_token="<|bos|>"
    )
    fast.chat_template = None
    return fast


def tiny_config(
    family: str = "llama", vocab_size: int = 2048, hidden: int = 64, layers: int = 4, **overrides
) -> transformers.PretrainedConfig:
    """A small config of the given family: a few layers, hidden 64–256, eager attention (deterministic on CPU)."""
    heads = max(2, hidden // 32)
    common = dict(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    llama_like = dict(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common, **llama_like)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, **llama_like)
    elif family == "mistral":
        config = transformers.MistralConfig(**common, **llama_like)
    elif family == "phi3":
        config = transformers.Phi3Config(**common, **llama_like)
    elif family == "gemma2":
        config = transformers.Gemma2Config(
            **common, **llama_like, head_dim=hidden // heads, final_logit_softcapping=30.0, query_pre_attn_scalar=16
        )
    elif family == "gpt2":
        config = transformers.GPT2Config(
            **common, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024, tie_word_embeddings=False
        )
    elif family == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            **common,
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            **llama_like,
            head_dim=hidden // heads,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    elif family == "gpt_oss":
        config = transformers.GptOssConfig(
            **common,
            **{**llama_like, "intermediate_size": 64},
            head_dim=hidden // heads,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=128,
            **_gpt_oss_yarn(llama_like["max_position_embeddings"]),
        )
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join(FAMILIES)}")
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    return config


def _gpt_oss_yarn(max_positions: int) -> dict:
    """GPT-OSS's YaRN (4096 positions stretched by 32) with the same ratio for a tiny context: transformers warns when
    the factor disagrees with max_position_embeddings / original_max_position_embeddings. transformers 5 names the
    dict ``rope_parameters`` (with rope_theta inside), 4.x ``rope_scaling``."""
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    yarn["original_max_position_embeddings"] = max_positions // 32
    if "rope_parameters" in inspect.signature(transformers.GptOssConfig.__init__).parameters:
        return {"rope_parameters": {**yarn, "rope_theta": 150000.0}}
    return {"rope_scaling": yarn}


def tiny_model(
    family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs
) -> transformers.PreTrainedModel:
    """A randomly initialised causal LM of :func:`tiny_config`, seeded."""
    config = tiny_config(family, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()


class Linear4bitMoeExperts(torch.nn.Module):
    """Experts in the layout of community pre-quantized 4-bit checkpoints: per-expert ``bnb.nn.Linear4bit`` lists
    (``F.linear`` orientation) run by a per-expert loop. That loop is the stock path leantrain's grouped 4-bit
    experts (moe4bit) replace and fall back to; the demo trains on it, and the tests and benchmarks build it from
    stock experts (``testkit.moe4bit_models``).

    gpt-oss style when ``alpha``/``limit`` are given (clamp-SwiGLU on interleaved gate/up rows, biases); otherwise
    ``act_fn(gate) * up`` on concatenated halves (Qwen3-MoE / Mixtral style). Routing weights may be ``[T, top_k]``
    or dense ``[T, E]``."""

    def __init__(
        self,
        gate_up_projs: torch.nn.ModuleList,
        down_projs: torch.nn.ModuleList,
        alpha: float | None = None,
        limit: float | None = None,
        *,
        act_fn: torch.nn.Module | None = None,
    ):
        super().__init__()
        self.num_experts = len(gate_up_projs)
        self.hidden_size = gate_up_projs[0].in_features
        self.expert_dim = down_projs[0].in_features
        self.gate_up_projs, self.down_projs = gate_up_projs, down_projs
        if alpha is not None:  # moe4bit reads the activation from these attributes: set only the one that applies
            self.alpha, self.limit = alpha, limit
        else:
            self.act_fn = act_fn

    def _gate(self, h: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "alpha"):  # act(gate) * up on concatenated halves
            g, u = h.chunk(2, dim=-1)
            return self.act_fn(g) * u
        # gpt-oss clamp-SwiGLU on interleaved gate/up columns, grouped as moe4bit's grouped path groups it
        g, u = h.unflatten(-1, (-1, 2)).unbind(-1)
        g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.hidden_size)
        indices = router_indices.reshape(x.shape[0], -1)
        weights = routing_weights.reshape(x.shape[0], -1)
        dense = weights.shape[1] == self.num_experts and indices.shape[1] != self.num_experts
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(indices, self.num_experts).permute(2, 1, 0)  # [E, k, T]
            hit = mask.sum(dim=(1, 2)).nonzero().flatten().tolist()
        for expert in hit:  # the per-expert loop of the checkpoint layout, host syncs included
            slot, token = torch.where(mask[expert])
            y = self.down_projs[expert](self._gate(self.gate_up_projs[expert](x[token])))
            w = weights[token, expert] if dense else weights[token, slot]
            out.index_add_(0, token, (y * w[:, None]).float())
        return out.to(hidden_states.dtype).view(hidden_states.shape)


def _linear4bit(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Module:
    import bitsandbytes as bnb

    quant = {"quant_type": "nf4", "compress_statistics": True}
    layer = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], bias=True, device="meta", **quant)
    layer.weight = bnb.nn.Params4bit(weight.detach().clone(), requires_grad=False, blocksize=64, module=layer, **quant)
    layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    layer = layer.to(weight.device)  # bitsandbytes quantizes on the first move to a device
    # bitsandbytes sets a layer's compute dtype on its first forward: set it now for every expert (a routed batch
    # reaches only some), so the experts agree (moe4bit declines experts with mixed compute dtypes).
    with torch.enable_grad():
        layer(torch.zeros(2, weight.shape[1], dtype=weight.dtype, device=weight.device, requires_grad=True))
    return layer


def linear4bit_experts(model: torch.nn.Module) -> int:
    """Swap every stock gpt-oss experts module of ``model`` for frozen nf4 :class:`Linear4bitMoeExperts` holding
    the same weights; returns how many were swapped. Every expert's row length (hidden and intermediate size) must
    be a multiple of 64, bitsandbytes' blocksize: its CPU 4-bit matmul is wrong otherwise."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "GptOssExperts":
            continue
        gate_up, down = module.gate_up_proj.detach().transpose(1, 2), module.down_proj.detach().transpose(1, 2)
        if gate_up.shape[-1] % 64 or down.shape[-1] % 64:
            raise ValueError(f"{name}: hidden and intermediate sizes must be multiples of 64 (bitsandbytes blocks)")
        ups = torch.nn.ModuleList(_linear4bit(gate_up[e], module.gate_up_proj_bias[e]) for e in range(len(gate_up)))
        downs = torch.nn.ModuleList(_linear4bit(down[e], module.down_proj_bias[e]) for e in range(len(down)))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Linear4bitMoeExperts(ups, downs, module.alpha, module.limit))
        swapped += 1
    return swapped


def settle_4bit(model: torch.nn.Module) -> None:
    """One training step's forward and backward on a dummy batch, gradients dropped: on CPU, a model's first
    training forward through fresh bitsandbytes 4-bit experts came out ~1e-4 off every later forward on the same
    inputs (bitsandbytes settles per-layer state on first use). Run it before training (and before patching), so a
    stock and a patched run start from the same state."""
    ids = torch.zeros(1, 4, dtype=torch.long, device=model.device)
    with torch.enable_grad():
        model(input_ids=ids).logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
