"""gguf_convert_and_push: GGUF files from the merged model, verified in llama.cpp, pushed in one commit."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slimtune.core import atomic
from slimtune.export import (
    convert_hf_to_gguf,
    llama_cpp_available,
    needs_llama_cpp,
    push_folder,
    quantize_gguf,
    render_model_card,
    render_modelfile,
    resolve_token,
    verify_gguf,
)
from slimtune.export.gguf_adapter import ADAPTER_GGUF_SUFFIX, convert_adapter_to_gguf, verify_adapter_gguf
from slimtune.export.gguf_mmproj import (
    convert_mmproj_to_gguf,
    mmproj_file_name,
    verify_mmproj,
    writes_mmproj,
)
from slimtune.export.gguf_tokenizer_check import check_tokenizer_export
from slimtune.export.gguf_verify import check_complete
from slimtune.export.model_card import base_license, chat_template_outcome
from slimtune.export.previous_gguf import set_aside_previous_ggufs
from slimtune.merge.nf4 import TRAINING_NF4
from slimtune.plan.run_plan import RunPlan, plan_for
from slimtune.spec.schema import PipelineSpec

log = logging.getLogger(__name__)
# Fixed verification prompts: plain text, digits, punctuation and a chat turn, so that tokenizer and
# logits differences between the merged model and the GGUF show up.
VERIFY_PROMPTS = [
    "The capital of France is Paris.",
    "<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n<|im_start|>assistant\n",
    "Spell the word 'garden' backwards: nedrag!",
]


@dataclass
class ExportResult:
    """The GGUF files written (name -> bytes), their verification, and the push (if any)."""

    files: dict[str, int]
    verification: dict[str, dict] = field(default_factory=dict)
    pushed: dict | None = None
    adapter: dict | None = None  # the LoRA adapter GGUF (export.adapter_gguf) and its check against merged
    tokenizer: dict | None = None  # export.gguf_tokenizer as_is: why the ids may differ, measured in llama.cpp
    chat_template: dict | None = None  # the Modelfile's TEMPLATE format, or "none" with why and how to chat
    mmproj: dict | None = None  # the vision projector GGUF (llama.cpp's --mmproj) and its check, or why not

    def to_dict(self) -> dict:
        return asdict(self)


def _convert(spec: PipelineSpec, merged_dir: Path, out_dir: Path) -> list[Path]:
    """Write one GGUF per requested type; k-quants are made by llama.cpp from an f16 intermediate."""
    split = int(spec.export.split_max_size_gb * 1e9) if spec.export.split_max_size_gb else None
    written: list[Path] = []
    as_is = spec.export.gguf_tokenizer == "as_is"
    f16_intermediate: Path | None = None
    (out_dir / f".{spec.name}-f16-intermediate.gguf").unlink(missing_ok=True)  # left by a killed run
    for method in spec.export.gguf:
        target = out_dir / f"{spec.name}-{method}.gguf"
        if not needs_llama_cpp(method):
            written += convert_hf_to_gguf(
                merged_dir, target, method, split_max_bytes=split, name=spec.name, tokenizer_as_is=as_is
            )
            continue
        if f16_intermediate is None:
            f16_intermediate = out_dir / f".{spec.name}-f16-intermediate.gguf"
            convert_hf_to_gguf(  # the k-quants keep the name
                merged_dir, f16_intermediate, "f16", name=spec.name, tokenizer_as_is=as_is
            )
        written.append(quantize_gguf(f16_intermediate, target, method))
    if f16_intermediate is not None:
        f16_intermediate.unlink(missing_ok=True)
    return written


LORA_FACTS = ("r", "alpha", "dropout", "target_modules", "use_rslora")


def _mmproj(spec: PipelineSpec, merged_dir: Path, out_dir: Path, files: list[Path]) -> dict | None:
    """Every multimodal layout slimtune trains (Gemma 3, Mistral 3, Qwen3.5, Gemma 4): llama.cpp's vision projector
    GGUF beside the text GGUFs, checked whole and (export.verify) its image embeddings against transformers'
    ({"skipped": why} for a vision config llama.cpp cannot run); None for a text checkpoint."""
    if not files or not writes_mmproj(merged_dir):
        return None
    try:
        path = convert_mmproj_to_gguf(merged_dir, out_dir / mmproj_file_name(spec.name), name=spec.name)
    except ValueError as exc:  # a vision config llama.cpp would run differently: the text GGUFs stand on their own
        log.warning("no mmproj file: %s", exc)
        return {"skipped": str(exc)}
    check_complete(path)
    record: dict = {"file": path.name, "bytes": path.stat().st_size}
    if spec.export.verify:
        if llama_cpp_available():
            record["verification"] = verify_mmproj(path, files[0], merged_dir)
        else:
            record["verification"] = {
                "skipped": "llama-cpp-python is not installed (pip install 'slimtune[llama-cpp]')"
            }
    log.info("mmproj GGUF: %s", record)
    return record


def card_hyperparameters(spec: PipelineSpec, trained: Mapping[str, Any], compute_dtype: str) -> dict[str, object]:
    """The training hyperparameters for the cards, named as Trainer's cards name them. The batch figures,
    optimizer and precision are the ones training ran with (`trained`: the train report's fields), which an
    "auto" micro-batch or an out-of-memory downshift makes differ from the spec's."""
    train = spec.train
    micro_batch = trained.get("micro_batch_size") or train.micro_batch_size
    accumulation = trained.get("gradient_accumulation_steps") or train.gradient_accumulation_steps
    length = {"training_steps": train.max_steps} if train.max_steps else {"num_epochs": train.epochs}
    total = micro_batch * accumulation * train.world_size if isinstance(micro_batch, int) else None
    quant = TRAINING_NF4
    return {
        "learning_rate": train.learning_rate,
        "lr_scheduler_type": train.lr_scheduler,
        "warmup_steps": train.warmup_steps,
        **length,
        "steps_trained": trained.get("steps"),
        "train_batch_size": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "total_train_batch_size": total,
        "num_devices": train.world_size,
        "optimizer": trained.get("optimizer") or train.optimizer,
        "weight_decay": train.weight_decay,
        "max_grad_norm": train.max_grad_norm,
        "precision": trained.get("precision") or train.precision,
        "seed": train.seed,
        "sequence_len": spec.data.max_seq_length,
        "sample_packing": spec.data.packing,
        "gradient_checkpointing": spec.lora.gradient_checkpointing,
        "quantization": f"4-bit {quant.quant_type}{', double quant' if quant.compress_statistics else ''}, "
        f"compute {compute_dtype}",
    }


def card_license(spec: PipelineSpec, model_dir: str) -> str | None:
    """The license for the cards: the base model's own (in `model_dir`) when its card names one, else export.license."""
    return base_license(Path(model_dir)) or spec.export.license


def _card(
    spec: PipelineSpec, plan: RunPlan, merged_dir: Path, files: list[Path], summary: dict, mmproj: dict | None = None
) -> tuple[str, str, dict[str, str]]:
    """The model card, the Modelfile and what the Modelfile does with the chat template (for the report)."""
    tok_cfg = (
        json.loads((merged_dir / "tokenizer_config.json").read_text())
        if (merged_dir / "tokenizer_config.json").exists()
        else {}
    )
    template = tok_cfg.get("chat_template")
    if template is None and (merged_dir / "chat_template.jinja").exists():
        template = (merged_dir / "chat_template.jinja").read_text()
    quants = [{"file": f.name, "method": f.stem.rsplit("-", 1)[-1], "size_bytes": f.stat().st_size} for f in files]
    if mmproj and "file" in mmproj:  # after the text GGUFs: the first row is the one the card recommends
        quants.append(
            {"file": mmproj["file"], "method": "f16 vision projector (--mmproj)", "size_bytes": mmproj["bytes"]}
        )
    card = render_model_card(
        repo_id=spec.export.push.repo_id if spec.export.push else None,
        name=spec.name,
        base_model=spec.model.name_or_path,
        quants=quants,
        datasets=spec.data.files(),
        lora={k: summary["spec"]["lora"][k] for k in LORA_FACTS},
        metrics=summary.get("train"),
        license_id=card_license(spec, plan.model_dir),
        hyperparameters=card_hyperparameters(
            spec, {**(summary.get("train") or {}), **(summary.get("trained_with") or {})}, plan.compute_dtype
        ),
    )
    eos, bos = tok_cfg.get("eos_token"), tok_cfg.get("bos_token")
    tokens = {"eos_token": eos if isinstance(eos, str) else None, "bos_token": bos if isinstance(bos, str) else None}
    modelfile = render_modelfile(files[0].name, template, **tokens)
    return card, modelfile, chat_template_outcome(files[0].name, template, **tokens)


def adapter_gguf_name(spec: PipelineSpec) -> str:
    """File name of the LoRA adapter GGUF, beside the model GGUFs (`slimtune.inference.generate` skips it)."""
    return f"{spec.name}{ADAPTER_GGUF_SUFFIX}"


def _adapter_gguf(
    spec: PipelineSpec, plan: RunPlan, merged_dir: Path, adapter_dir: Path, out_dir: Path, files: list[Path]
) -> dict:
    """Write the adapter GGUF; verify llama.cpp's base f16 + adapter against the merged f16 GGUF."""
    from transformers import AutoTokenizer

    base_dir = Path(plan.model_dir)
    path = convert_adapter_to_gguf(adapter_dir, plan.config, out_dir / adapter_gguf_name(spec))
    record: dict = {"file": path.name, "bytes": path.stat().st_size}
    if not spec.export.verify:
        return record
    if not llama_cpp_available():
        record["verification"] = {"skipped": "llama-cpp-python is not installed (pip install 'slimtune[llama-cpp]')"}
        return record
    # Both sides in f16, so the difference measured is the adapter's (applied at run time in f32) vs merged
    # f16 weights, not a precision gap. The intermediates live in a dot-folder and are always removed.
    with tempfile.TemporaryDirectory(prefix=".adapter-verify-", dir=out_dir) as tmp:
        base_gguf = convert_hf_to_gguf(base_dir, Path(tmp) / "base-f16.gguf", "f16")[0]
        merged_f16 = out_dir / f"{spec.name}-f16.gguf"
        if merged_f16 not in files:
            merged_f16 = convert_hf_to_gguf(merged_dir, Path(tmp) / "merged-f16.gguf", "f16")[0]
        tokenizer = AutoTokenizer.from_pretrained(merged_dir)
        prompts = VERIFY_PROMPTS + spec.eval.prompts
        record["verification"] = verify_adapter_gguf(base_gguf, path, merged_f16, prompts, tokenizer)
    record["verification"]["merge_source"] = spec.merge.source
    return record


def gguf_convert_and_push(
    spec: PipelineSpec, merged_dir: Path, adapter_dir: Path, summary: dict, plan: RunPlan | None = None
) -> ExportResult:
    """Convert, verify each file against the merged model, write card + Modelfile, push if asked.

    Args:
        plan: the flow's run plan (the base model's folder and config); resolved here when called on its own.
    """
    plan = plan_for(spec, plan)
    out_dir = spec.run_dir() / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _convert(spec, merged_dir, out_dir)
    result = ExportResult(files={f.name: f.stat().st_size for f in files})
    result.mmproj = _mmproj(spec, merged_dir, out_dir, files)
    if spec.export.gguf_tokenizer == "as_is" and files:
        result.tokenizer = check_tokenizer_export(merged_dir, strict=False).to_dict()
        log.info("GGUF tokenizer written as is: %s", result.tokenizer)
    if spec.export.verify:
        for f in files:
            if not llama_cpp_available():
                result.verification[f.name] = {
                    "skipped": "llama-cpp-python is not installed (pip install 'slimtune[llama-cpp]')"
                }
                continue
            result.verification[f.name] = verify_gguf(f, merged_dir, VERIFY_PROMPTS)
            log.info("verified %s: %s", f.name, result.verification[f.name])
    if spec.export.adapter_gguf:
        result.adapter = _adapter_gguf(spec, plan, merged_dir, adapter_dir, out_dir, files)
        log.info("adapter GGUF: %s", result.adapter)
    # the earlier run's GGUFs this export list no longer produces: gguf/ then holds this run's files only
    adapter = [adapter_gguf_name(spec)] if spec.export.adapter_gguf else []
    mmproj = [result.mmproj["file"]] if result.mmproj and "file" in result.mmproj else []
    set_aside_previous_ggufs(out_dir, [f.name for f in files] + adapter + mmproj)
    card, modelfile, result.chat_template = _card(spec, plan, merged_dir, files, summary, result.mmproj)
    log.info("Modelfile chat template: %s", result.chat_template)
    atomic.write_text(out_dir / "README.md", card)
    atomic.write_text(out_dir / "Modelfile", modelfile)
    push = spec.export.push
    if push is not None:
        upload = {f.name: f for f in files} | {"README.md": out_dir / "README.md", "Modelfile": out_dir / "Modelfile"}
        upload |= {name: out_dir / name for name in mmproj}
        if push.include_adapter:
            upload |= {f"adapter/{p.name}": p for p in adapter_dir.iterdir() if p.is_file()}
            if result.adapter is not None:
                upload[result.adapter["file"]] = out_dir / result.adapter["file"]
        if push.include_merged:
            upload |= {f"merged/{p.name}": p for p in merged_dir.iterdir() if p.is_file()}
        pushed = push_folder(
            upload,
            push.repo_id,
            private=push.private,
            revision=push.revision,
            token=resolve_token(),
            commit_message=f"slimtune: {spec.name}",
        )
        result.pushed = asdict(pushed)
    return result
