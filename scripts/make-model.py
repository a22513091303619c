#!/usr/bin/env python3
"""Writes a small random-weight llama GGUF that llama.cpp's llama-server can serve.

    .venv/bin/python scripts/make-model.py     # prints the model's path on stdout

No weights can be downloaded on these machines, so the real-server tests and the cost-curve
measurements run a model made here: llama architecture, hidden size 512, 8 layers, 8 heads,
F16 matrices, weights drawn from a fixed seed, so every machine serves the same model. Its
output is noise, but llama.cpp does the same work per token as for a trained model of that
shape, which is what a gate in front of it has to predict.

The vocabulary is a SentencePiece-style ("llama") one that llama.cpp's tokenizer accepts:
<unk>, <s>, </s>, the chat template's <|im_start|> and <|im_end|> (control tokens, so the
ChatML template costs a handful of tokens per message as with real models, not dozens of
characters), the 256 byte-fallback tokens, every printable ASCII character, and a few
hundred common English words with all their prefixes (the tokenizer merges adjacent pieces
only into pieces in the vocabulary, so a word is reachable only through its prefixes). Plain
English-ish text therefore comes out at a few characters per token, not the usual 4: the
gate must learn the ratio from `usage`, as it must for any real model.

Two properties are built into the weights on purpose:
- The model never ends a reply early. One residual dimension is held at a constant (the token
  embeddings set it, no layer writes to it), and the output rows of end-of-sequence, control
  and byte tokens have a large negative weight on it, so those tokens are never sampled. Every
  request therefore generates exactly `max_tokens`, which makes service times comparable.
- Replies are printable ASCII (byte tokens are never sampled), so streamed deltas are valid
  UTF-8.

The file goes to ${SLACKGATE_CACHE:-~/.cache/slackgate}/models/ (outside the checkout) and is
reused when present; it is written to a temporary name and renamed, so an interrupted run
never leaves a half-written model behind. Needs the `gguf` and `numpy` packages (installed in
the repository's .venv by scripts/venv.sh).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

# Bump when the model's contents change, so caches of the old one are not reused.
MODEL_VERSION = 2
SEED = 20240612

HIDDEN = 512
LAYERS = 8
HEADS = 8
HEADS_KV = 8
FFN = 1536
CONTEXT_TRAIN = 4096
INIT_STD = 0.02
# The residual dimension held constant, its value, and the weight that keeps tokens that must
# never be generated far below the rest (their logit is about -10 x 11 after the final norm).
PINNED_DIM = 0
PINNED_VALUE = 10.0
NEVER_WEIGHT = -10.0

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WORDS = """
the of and to in is was for that with as on by at from his her it an are were which be this
has had have not but they one all their been also its who after first new more other two
there he she or when we you your our can would will into time year years about over than
only may most some such these them then out up so what no any each both many used use under
between during where while through before him because against same well three made state
city world people part work could should very like just how do does did being much make
long because own down off high still around said set way since long later even must called
number another end small large great good life day days system data service request server
model token tokens time queue gate batch slot deadline prompt answer question please write
short summary text file report test user users network process memory load cost price
water house school company group family government public history early music name family
help here often second come back found place point home game team member area men women
page power line order given based known following several include including within without
""".split()

# Pieces and how the tokenizer may join them: a higher score is merged first.
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_BYTE = 6
SPACE = "\u2581"  # SentencePiece's visible space


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types, in id order: <unk>=0, <s>=1, </s>=2, the chat template's
    two control tokens, the bytes, then the pieces."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    scores = [0.0] * len(tokens)
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(TOKEN_BYTE)

    pieces: dict[str, None] = {SPACE: None}
    for c in range(33, 127):
        pieces[chr(c)] = None
    for word in dict.fromkeys(WORDS):
        # Both the word-initial form (after a space) and the bare form (sentence start or
        # after punctuation), each with every prefix so the merges can reach them.
        for form in (SPACE + word, word):
            for end in range(2, len(form) + 1):
                pieces[form[:end]] = None
    # Longer pieces score higher, so whole words win over fragments; the order within a
    # length is the insertion order (the sort is stable), which is fixed.
    for i, piece in enumerate(sorted(pieces, key=len)):
        tokens.append(piece)
        scores.append(float(len(piece)) - i * 1e-6)
        types.append(TOKEN_NORMAL)
    return tokens, scores, types


def weights(n_vocab: int, never: list[int]) -> dict[str, np.ndarray]:
    """Random weights in numpy (rows = outputs) order; see the module doc for the pinned dim."""
    rng = np.random.default_rng(SEED)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * INIT_STD).astype(np.float16)

    ones = np.ones(HIDDEN, dtype=np.float32)
    head_dim = HIDDEN // HEADS
    t: dict[str, np.ndarray] = {}

    embd = rng.standard_normal((n_vocab, HIDDEN), dtype=np.float32) * INIT_STD
    embd[:, PINNED_DIM] = PINNED_VALUE
    t["token_embd.weight"] = embd.astype(np.float16)

    for layer in range(LAYERS):
        p = f"blk.{layer}."
        t[p + "attn_norm.weight"] = ones.copy()
        t[p + "attn_q.weight"] = mat(HIDDEN, HIDDEN)
        t[p + "attn_k.weight"] = mat(HEADS_KV * head_dim, HIDDEN)
        t[p + "attn_v.weight"] = mat(HEADS_KV * head_dim, HIDDEN)
        out = mat(HIDDEN, HIDDEN)
        out[PINNED_DIM, :] = 0  # no layer writes to the pinned residual dimension
        t[p + "attn_output.weight"] = out
        t[p + "ffn_norm.weight"] = ones.copy()
        t[p + "ffn_gate.weight"] = mat(FFN, HIDDEN)
        t[p + "ffn_up.weight"] = mat(FFN, HIDDEN)
        down = mat(HIDDEN, FFN)
        down[PINNED_DIM, :] = 0
        t[p + "ffn_down.weight"] = down

    t["output_norm.weight"] = ones.copy()
    output = mat(n_vocab, HIDDEN)
    output[:, PINNED_DIM] = 0
    output[never, PINNED_DIM] = NEVER_WEIGHT
    t["output.weight"] = output
    return t


def write(path: Path) -> None:
    """Writes the model to `path` (atomically: a temporary file renamed into place)."""
    import gguf  # imported here so --help style failures name numpy/gguf separately

    tokens, scores, types = vocabulary()
    never = [i for i, ty in enumerate(types) if ty != TOKEN_NORMAL]
    tensors = weights(len(tokens), never)

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch="llama")
    writer.add_name(f"slackgate random llama h{HIDDEN} l{LAYERS} v{MODEL_VERSION}")
    writer.add_context_length(CONTEXT_TRAIN)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS_KV)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)


def main() -> int:
    cache = Path(os.environ.get("SLACKGATE_CACHE") or Path.home() / ".cache" / "slackgate")
    path = cache / "models" / f"random-llama-h{HIDDEN}-l{LAYERS}-v{MODEL_VERSION}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"make-model: writing {path}", file=sys.stderr)
        write(path)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
