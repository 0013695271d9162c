"""Tiny, seeded models and a byte-level BPE tokenizer trained on text that ships with Python.

Used by the demo, the tests and the benchmarks' smoke mode: nothing is downloaded from a hub.
"""

from __future__ import annotations

import functools
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
        )
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join(FAMILIES)}")
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    return config


def tiny_model(
    family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs
) -> transformers.PreTrainedModel:
    """A randomly initialised causal LM of :func:`tiny_config`, seeded."""
    config = tiny_config(family, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()
