# The embedded default run: `python train.py` with no config file uses this file.
# A tiny Llama learns to write Python from the standard library's own source (byte-level tokens, nothing
# downloaded), sized so that `make train` finishes in about 10 minutes on a 2-core CPU.
# Every setting, and its meaning, is listed at the top of train.py.
out_dir = "out/default"
data_dir = "data/cache/stdlib"
dim = 192
n_layers = 4
n_heads = 3
n_kv_heads = 1
ffn_dim = 512
max_seq_len = 512
tokens_per_micro_step = 4096
grad_accum = 2
learning_rate = 3e-3
warmup_steps = 30
max_steps = 600
eval_interval = 100
checkpoint_interval = 200
