"""Host syncs of unmodified HF training steps: what stops a whole training step from being captured as a graph.

    PYTHONPATH=src:. python3 -m benchmarks.tools.host_syncs --out OUT [--device cuda]

Runs `tendril.find_host_syncs` over each piece of a training step of small random-weight HF models (forward with
its loss, backward, AdamW step, and on CUDA the AMP grad scaler), with dropout and layerdrop off. On CUDA the
optimizer is `capturable` (its step counters stay on the device); on the CPU it cannot be, so its counter reads
show there. Writes OUT/host_syncs.json and OUT/host_syncs.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tendril


def _wav2vec2_ctc(device: torch.device) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        vocab_size=32, layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, mask_time_prob=0.0,
    )  # fmt: skip
    audio = torch.randn(4, 16000, device=device)
    labels = torch.randint(1, 32, (4, 20), device=device)
    return Wav2Vec2ForCTC(config).to(device).train(), lambda model: model(audio, labels=labels).loss


def _gpt2_lm(device: torch.device) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 1000, (4, 64), device=device)
    return GPT2LMHeadModel(config).to(device).train(), lambda model: model(ids, labels=ids).loss


MODELS = {"wav2vec2-ctc": _wav2vec2_ctc, "gpt2-lm": _gpt2_lm}


def step_syncs(name: str, device: torch.device) -> dict[str, Any]:
    """The host syncs of each piece of one training step of model `name`."""
    torch.manual_seed(0)
    model, loss_of = MODELS[name](device)
    optimizer = torch.optim.AdamW(model.parameters(), capturable=device.type == "cuda")
    pieces: dict[str, Any] = {}
    losses: list[torch.Tensor] = []
    pieces["forward and loss"] = tendril.find_host_syncs(lambda: losses.append(loss_of(model)))
    pieces["backward"] = tendril.find_host_syncs(lambda: losses[0].backward())
    pieces["AdamW step"] = tendril.find_host_syncs(optimizer.step)
    if device.type == "cuda":
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            scaled = scaler.scale(loss_of(model))
        scaled.backward()
        pieces["GradScaler step and update"] = tendril.find_host_syncs(
            lambda: (scaler.step(optimizer), scaler.update())
        )
    return {piece: [dataclasses.asdict(sync) for sync in report.syncs] for piece, report in pieces.items()}


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Host syncs of HF training steps",
        "",
        f"- command: `{result['command']}`",
        f"- device: {result['device']}; torch {result['torch']}; transformers {result['transformers']}; "
        f"{result['date']}",
        "",
        "| model | piece | where | via | op | count | why |",
        "|---|---|---|---|---|---:|---|",
    ]
    for model, pieces in result["models"].items():
        for piece, syncs in pieces.items():
            if not syncs:
                lines.append(f"| {model} | {piece} | none | | | | |")
            for sync in syncs:
                via = "" if sync["via"] == sync["where"] else f"`{sync['via']}`"
                lines.append(f"| {model} | {piece} | `{sync['where']}` | {via} | `{sync['op']}` | {sync['count']} "
                             f"| {sync['reason']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arguments = parser.parse_args()
    device = torch.device(arguments.device)
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {name: step_syncs(name, device) for name in MODELS}
    result = {
        "tool": "host_syncs",
        "command": f"python3 -m benchmarks.tools.host_syncs --out OUT --device {arguments.device}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "models": models,
    }
    arguments.out.mkdir(parents=True, exist_ok=True)
    (arguments.out / "host_syncs.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = _markdown(result)
    (arguments.out / "host_syncs.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
