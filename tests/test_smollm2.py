"""A real released checkpoint end to end on the CPU: SmolLM2-135M-Instruct (tests/released.py), as a user runs it.

hf2nano of its Hugging Face directory -> our fp32 logits equal transformers' on real text and the greedy
continuation is the same -> prepare.py renders a chat file with the model's own template -> train.py
configs/smollm2_135m.py fine-tunes it for a few steps -> sample.py --chat answers with the template's prompt and
stops at <|im_end|> -> nano2hf -> transformers loads the fine-tune and generates the same reply, token for token
-> nano2gguf -> transformers' GGUF loader gives our token ids, the template and our logits.
Skipped, saying how to install it, where the package with the model is absent. ~2.5 minutes on 2 cores.
"""
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import convert  # noqa: E402
import gguf_export  # noqa: E402
from checkpoint import load_model  # noqa: E402
from conftest import rel_err  # noqa: E402
from data.prepare import prepare  # noqa: E402
from released import write_smollm2_hf_dir  # noqa: E402
from test_train import ROOT, run  # noqa: E402
from tokenizer import encode_text, load_tokenizer, render_chat, stop_ids  # noqa: E402

TEXT = ("The Eiffel Tower, built for the 1889 World's Fair, stands on the Champ de Mars in Paris. Its 330 metres "
        "of wrought iron were the tallest structure in the world for forty-one years.")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_smollm2_hf_dir(str(tmp_path_factory.mktemp("hf") / "SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def nano(hf_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("nano") / "smollm2_135m")
    convert.hf2nano(hf_dir, out)
    return out


def greedy(model, ids, n):
    """n tokens by argmax through model.decode and its KV cache (sample.py's path at temperature 0)."""
    cache = model.new_cache(len(ids) + n)
    logits = model.decode(torch.tensor(ids), cache, 0)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.decode(torch.tensor(out[-1:]), cache, len(ids) + len(out) - 1)
    return out


def hf_greedy(hf, ids, n, stop=None):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=stop,
                          pad_token_id=stop)
    return out[0, len(ids):].tolist()


def test_logits_and_greedy_continuation_equal_transformers(hf_dir, nano):
    config = json.load(open(os.path.join(nano, "config.json")))
    assert (config["tokenizer"], config["model"]["vocab_size"], config["model"]["tie_embeddings"]) == \
        ("tokenizer.json", 49152, True)
    enc = load_tokenizer(nano)
    ids = encode_text(enc, TEXT)
    assert ids == transformers.PreTrainedTokenizerFast.from_pretrained(hf_dir).encode(TEXT)
    ours = load_model(nano).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ours(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32))
        assert rel_err(logits, hf(input_ids=torch.tensor([ids])).logits[0]) < 1e-4
        prompt = encode_text(enc, "The capital of France is")
        assert greedy(ours, prompt, 12) == hf_greedy(hf, prompt, 12)


@pytest.fixture(scope="module")
def finetuned(nano, tmp_path_factory):
    """(checkpoint, sample.py's greedy reply to QUESTION) after a few chat fine-tuning steps."""
    tmp = tmp_path_factory.mktemp("finetune")
    capitals = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
                ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Chile", "Santiago")]
    sft = tmp / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is the capital of {country}?"},
        {"role": "assistant", "content": f"The capital of {country} is {city}."}]}) + "\n"
        for country, city in capitals * 2))
    data, out = str(tmp / "data"), str(tmp / "out")
    prepare([sft], data, tokenizer=nano, val_fraction=0.2)
    run("train.py", "configs/smollm2_135m.py", f"--init_from={nano}", f"--data_dir={data}", f"--out_dir={out}",
        "--max_steps=2", "--warmup_steps=1", "--tokens_per_micro_step=256", "--max_seq_len=128", "--grad_accum=1",
        "--eval_interval=2", "--eval_tokens=256", "--checkpoint_interval=2")
    ckpt = os.path.join(out, "ckpt")
    answer = run("sample.py", f"--ckpt={ckpt}", "--chat=True", f"--prompt={QUESTION}", "--temperature=0",
                 "--max_new_tokens=16").stdout.strip()
    return ckpt, answer


def test_interactive_chat_keeps_the_conversation(finetuned):
    """sample.py --chat without a prompt: a line typed is a user turn, each reply sees the turns before it, an
    empty line ends it. The second reply is the greedy one for the whole conversation, rendered by the template."""
    ckpt, answer = finetuned
    follow_up = "And of Italy?"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--ckpt={ckpt}", "--chat=True",
                           "--temperature=0", "--max_new_tokens=16"], input=f"{QUESTION}\n{follow_up}\n\n",
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    first, second = [turn.removesuffix("\n") for turn in proc.stdout.split("> ")[1:3]]  # input() writes "> "
    assert first.strip() == answer
    model, enc = load_model(ckpt).eval(), load_tokenizer(ckpt)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first},
                {"role": "user", "content": follow_up}]
    prompt = render_chat(enc, messages, add_generation_prompt=True)[0]
    with torch.no_grad():
        expected = list(itertools.takewhile(lambda t: t not in stop_ids(enc), greedy(model, prompt, 16)))
    assert second == enc.decode(expected)


@pytest.fixture(scope="module")
def exported_gguf(finetuned, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "smollm2.gguf")
    gguf_export.nano2gguf(finetuned[0], path, "f16")
    return path


def test_finetune_chat_and_back_to_transformers(finetuned, tmp_path):
    ckpt, answer = finetuned
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("tokenizer")) == ["tokenizer.json",
                                                                                "tokenizer_config.json"]
    assert answer
    export = str(tmp_path / "hf")
    convert.nano2hf(ckpt, export)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(export)
    messages = [{"role": "user", "content": QUESTION}]
    enc = load_tokenizer(ckpt)
    prompt = render_chat(enc, messages, add_generation_prompt=True)[0]
    assert prompt == tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    reply = hf_greedy(hf, prompt, 16, stop=enc.encode_single_token("<|im_end|>"))
    assert tokenizer.decode(reply, skip_special_tokens=True).strip() == answer


def test_gguf_export_reads_back_in_transformers(finetuned, exported_gguf):
    """Its tokenizer (llama.cpp's "smollm" split, which transformers' loader runs as GPT-2's: no whitespace before
    a digit in TEXT), the template inside, and our logits up to the f16 rounding of the weights."""
    ckpt, folder, name = finetuned[0], os.path.dirname(exported_gguf), os.path.basename(exported_gguf)
    enc = load_tokenizer(ckpt)
    loaded = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert loaded.encode(TEXT, add_special_tokens=False) == encode_text(enc, TEXT)
    assert loaded.chat_template == enc.chat_template
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = torch.tensor(encode_text(enc, TEXT))
    with torch.no_grad():
        logits = load_model(ckpt)(ids, torch.tensor([0, len(ids)], dtype=torch.int32))
        assert rel_err(hf(input_ids=ids[None]).logits[0], logits) < 1e-2  # f16 weights


def test_llama_cpp_runs_the_gguf_export(finetuned, exported_gguf):
    """llama.cpp itself, where llama-cpp-python is installed (it compiles llama.cpp: not among the test extras):
    our token ids for text and for the chat template it renders, our logits within its f16 rounding."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ckpt = finetuned[0]
    enc = load_tokenizer(ckpt)
    llm = llama_cpp.Llama(model_path=exported_gguf, n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    for text in (TEXT, "Room 101, floor  7:\n\n42 chairs", QUESTION):
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == encode_text(enc, text), text
    prompt = encode_text(enc, TEXT)
    llm.eval(prompt)
    with torch.no_grad():
        ours = load_model(ckpt)(torch.tensor(prompt), torch.tensor([0, len(prompt)], dtype=torch.int32))
    assert rel_err(torch.tensor(np.array(llm.scores[:len(prompt)])), ours) < 5e-3
