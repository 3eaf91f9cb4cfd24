"""Writes the GPT-2 parity fixture: a small random GPT-2 in Hugging Face's layout
(`config.json` + `model.safetensors`, as `save_pretrained` writes them) and what
`transformers` computes with it (`expected.json`: the last hidden states of `GPT2Model` and the
LM-head logits for fixed token sequences, one of them right-padded with an attention mask).
The Rust test `gpt2_matches_transformers` loads the same directory through our loader and
checks our forward pass against these numbers (f32, max abs difference below 1e-5).

Every parameter is drawn at random (layer-norm gains and biases too, which a fresh model leaves
at 1 and 0), so a wrong transpose, epsilon, activation or mask shows.

Usage (PyTorch and transformers, e.g. `pip install transformers` in scripts/setup.sh's venv):
    python scripts/parity/gpt2_fixture.py recommender/tests/fixtures/gpt2-parity
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(1234)
config = GPT2Config(
    vocab_size=96,
    n_positions=32,
    n_embd=32,
    n_layer=2,
    n_head=4,
    layer_norm_epsilon=1e-5,
    activation_function="gelu_new",
    bos_token_id=0,
    eos_token_id=0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
model = GPT2LMHeadModel(config).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        p.normal_(0.0, 0.3)
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
            p.add_(1.0)
model.save_pretrained(out, safe_serialization=True)
(out / "generation_config.json").unlink(missing_ok=True)  # not read; keeps the fixture small

input_ids = torch.tensor(
    [
        [5, 17, 3, 88, 42, 9, 60, 1, 33, 70],
        [7, 7, 2, 95, 11, 50, 0, 0, 0, 0],
    ]
)
attention_mask = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
    ]
)
with torch.no_grad():
    hidden = model.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
expected = {
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "input_ids": input_ids.tolist(),
    "attention_mask": attention_mask.tolist(),
    "last_hidden_state": hidden.tolist(),
    "logits": logits.tolist(),
}
(out / "expected.json").write_text(json.dumps(expected))
print(f"wrote {out}: hidden {tuple(hidden.shape)}, logits {tuple(logits.shape)}")
