"""The native models against the families' published modelling files, number for number.

For each family, a small random model of stabledrl's native class (grouped-query heads,
LLaDA's RoPE base) is saved; the published modelling and configuration files are copied
beside it and named in its config.json's ``auto_map``, so that transformers loads the saved
checkpoint with the published code (``trust_remote_code``), as a user's would. Then:

- the published code must load every weight (no missing or unexpected key);
- the native model's logits for a left-padded batch (padding 0, 2 and 5 columns), in one
  forward, must equal the published code's for each row run alone, unpadded (SDAR: under
  SDAR's own block-causal mask over the row, as its sampler passes it), |Δ| ≤ 1e-4 in float32.

The published files are not part of stabledrl: fetch them and point the script at the
folders holding them, for example (Gen-Verse/dLLM-RL, JetAstra/SDAR, JianyuanZhong/StableDRL):

    python benchmarks/published_parity.py --llada dLLM-RL/models/llada --llada StableDRL/networks \\
        --dream dLLM-RL/models/dream --sdar SDAR/training/model/SDAR-8B-Chat --out benchmarks/results/published_parity.json

LLaDA's and Dream's files need transformers < 4.58; SDAR's needs flash-attn or stabledrl's torch
stand-in (installed here). docs/scale-out.md, "Native models", reports the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from stabledrl import _compat
from stabledrl.models.native import DreamConfig, LLaDAConfig, SDARConfig, NATIVE_MODELS

TOLERANCE = 1e-4
VOCAB = 96
PADS = (0, 2, 5)
T = 13
BLOCK = 4

_AUTO_MAP = {
    "llada": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"},
    "dream": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "sdar": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
}
_FILES = {"llada": ("modeling_llada.py", "configuration_llada.py"),
          "dream": ("modeling_dream.py", "configuration_dream.py"),
          "sdar": ("modeling_sdar.py", "configuration_sdar.py")}


def _config(family: str):
    """A small config of each family, every field its published file reads given explicitly."""
    if family == "llada":
        return LLaDAConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=96, vocab_size=VOCAB,
                           embedding_size=VOCAB, block_type="llama", activation_type="silu", layer_norm_type="rms",
                           rope=True, rope_theta=500000.0, weight_tying=False, max_sequence_length=64,
                           attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0, mask_token_id=VOCAB - 1,
                           pad_token_id=0, eos_token_id=1, init_device="cpu")
    if family == "dream":
        return DreamConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, max_position_embeddings=64,
                           mask_token_id=VOCAB - 1, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return SDARConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, rope_theta=1000000.0, max_position_embeddings=64,
                      block_size=BLOCK, mask_token_id=VOCAB - 1, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                      fuse_cross_entropy=False)


def _random_native(family: str, seed: int):
    torch.manual_seed(seed)
    model = NATIVE_MODELS[family](_config(family)).eval()
    with torch.no_grad():  # weights of order one, so that logits differ visibly between positions
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    return model


def _sdar_mask(positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B, T) positions and real-token flags -> (B, T, T) SDAR's block-causal mask: blocks of
    BLOCK counted from each row's first real token; a query sees real keys of its block or earlier."""
    blk = positions // BLOCK  # (B, T)
    return (blk[:, None, :] <= blk[:, :, None]) & real[:, None, :]


def check(family: str, folder: Path, seed: int = 0) -> dict:
    native = _random_native(family, seed)
    tmp = Path(tempfile.mkdtemp())
    native.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["auto_map"] = _AUTO_MAP[family]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 0}))  # Dream reads one
    for source in folder.glob("*.py"):  # the modelling file and what it imports (Dream's generation_utils ...)
        shutil.copy2(source, tmp / source.name)
    if family == "sdar":
        _compat.install_remote_code_shims()
    auto = transformers.AutoModelForCausalLM if family == "sdar" else transformers.AutoModel
    published = auto.from_pretrained(str(tmp), trust_remote_code=True, dtype=torch.float32).eval()
    # Every weight loaded: the same names, and each published tensor equals the native one (Dream's
    # from_pretrained returns no loading info).
    theirs_sd, ours_sd = published.state_dict(), native.state_dict()
    info = {"missing_keys": [k for k in theirs_sd if k not in ours_sd],
            "unexpected_keys": [k for k in ours_sd if k not in theirs_sd],
            "unequal_tensors": [k for k in ours_sd if k in theirs_sd and not torch.equal(ours_sd[k], theirs_sd[k])]}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (len(PADS), T), generator=g)  # (B, T)
    real = torch.arange(T)[None, :] >= torch.tensor(PADS)[:, None]  # (B, T) left padding
    ids = ids.masked_fill(~real, 0)
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    with torch.no_grad():
        if family == "sdar":
            mask = _sdar_mask(positions, real)
            ours = native(ids, attention_mask=mask, position_ids=positions).logits  # (B, T, V)
        else:
            ours = native(ids, attention_mask=real.long()).logits  # (B, T, V)
        worst, scale = 0.0, 0.0
        for b, pad in enumerate(PADS):
            row = ids[b:b + 1, pad:]  # (1, T - pad)
            if family == "sdar":
                n = row.size(1)
                own = _sdar_mask(torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))[:, None]  # (1, 1, n, n)
                theirs = published(input_ids=row, attention_mask=own, position_ids=torch.arange(n)[None],
                                   use_cache=False).logits
            else:
                theirs = published(input_ids=row).logits  # (1, T - pad, V)
            worst = max(worst, float((ours[b, pad:] - theirs[0]).abs().max()))
            scale = max(scale, float(theirs.abs().max()))
    shutil.rmtree(tmp)
    return {"family": family, "published_files": str(folder), "published_class": type(published).__name__,
            **info, "max_abs_diff": worst, "max_abs_logit": scale, "pads": list(PADS),
            "holds": worst <= TOLERANCE and not any(info.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for family in ("llada", "dream", "sdar"):
        p.add_argument(f"--{family}", action="append", default=[], type=Path,
                       help=f"a folder holding {' and '.join(_FILES[family])} (repeatable: several copies)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/published_parity.json"))
    args = p.parse_args(argv)
    rows = [check(family, folder) for family in ("llada", "dream", "sdar") for folder in getattr(args, family)]
    for r in rows:
        print(f"{r['family']:6s} {r['published_files']}: max |Δ| {r['max_abs_diff']:.2e} (logits up to "
              f"{r['max_abs_logit']:.1f}), missing {len(r['missing_keys'])}, unexpected {len(r['unexpected_keys'])}, "
              f"unequal {len(r['unequal_tensors'])}"
              f" -> {'holds' if r['holds'] else 'FAILS'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tolerance": TOLERANCE, "transformers": transformers.__version__,
                                    "torch": torch.__version__, "python": platform.python_version(),
                                    "command": "python benchmarks/published_parity.py " + " ".join(sys.argv[1:]),
                                    "rows": rows}, indent=2) + "\n")
    return 0 if rows and all(r["holds"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
