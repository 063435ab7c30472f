"""Makes a small Llama checkpoint with random weights (fixed seed) and a byte-level BPE
tokenizer trained here on the repository's own docs, for running vLLM without a model
hub. Idempotent: an existing complete model directory with the same settings is kept.

    python make_model.py OUT_DIR [--layers 2 --hidden 256 --heads 4 --kv-heads 2
                                  --intermediate 512 --vocab 2048 --seed 0]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max-pos", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    want = {k: v for k, v in vars(a).items() if k != "out"}
    stamp = os.path.join(a.out, "maru-model.json")
    try:
        with open(stamp) as f:
            if json.load(f) == want:
                print(a.out)
                return 0
    except (OSError, ValueError):
        pass

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(a.out, exist_ok=True)
    # Tokenizer: byte-level BPE on text every clone has.
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "README.md")))
    if not files:
        print(f"no training text under {ROOT}/docs", file=sys.stderr)
        return 1
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=a.vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(a.out)

    head_dim = a.hidden // a.heads
    cfg = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=head_dim,
        max_position_embeddings=a.max_pos,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg)
    # Larger than the default init (std 0.02) so that the random model's next token
    # depends strongly on its context: a wrong KV cache then changes the output.
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if prm.dim() >= 2:
                prm.normal_(0.0, 1.0 / (prm.shape[-1] ** 0.5))
    model = model.to(torch.bfloat16)
    model.save_pretrained(a.out, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump(want, f)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
