"""Talking to a finished run: `slimtune generate` and `slimtune chat`.

Two backends answer the same calls: llama.cpp on the run's GGUF (the default: it is what users deploy)
and transformers on `merged/` (`--backend hf`). Both take token ids from the run's own HF tokenizer and
chat template, so a prompt means the same thing to either backend and to training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from slimtune.export.gguf_adapter import ADAPTER_GGUF_SUFFIX
from slimtune.export.gguf_mmproj import MMPROJ_GGUF_SUFFIX
from slimtune.models.multimodal import text_model_load_kwargs

# Default GGUF when the run wrote several: the most precise type first (what the run verified best).
PRECISION_ORDER = (
    *("f32", "bf16", "f16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_0", "q4_k_m", "q4_k_s", "iq4_nl", "iq4_xs"),
    *("q4_0", "q3_k_l", "q3_k_m", "q3_k_s", "q2_k"),
)
# llama.cpp allocates its KV cache for the whole context up front; an 8B model's 128k would take GiBs.
_MAX_CTX = 4096


class RunDirError(ValueError):
    """The run directory lacks what the command needs; the message says which folder and what to do."""


class PromptTooLong(ValueError):
    """A prompt (one chat turn, after dropping the older ones) that leaves no room in the context."""


class _Backend(Protocol):
    def generate(self, ids: list[int], max_new_tokens: int, temperature: float) -> list[int]: ...


def read_run_spec(run_dir: Path) -> dict[str, Any]:
    """The spec a run ran with: spec.effective.yaml, or the spec inside report.json (older runs)."""
    from slimtune.core.bounded import load_yaml

    effective = run_dir / "spec.effective.yaml"
    if effective.is_file():
        return load_yaml(effective.read_text(encoding="utf-8"))
    report = run_dir / "report.json"
    if report.is_file():
        return json.loads(report.read_text(encoding="utf-8"))["spec"]
    raise RunDirError(f"{run_dir}: no spec.effective.yaml or report.json; give the directory of a finished run")


def merged_dir(run_dir: Path) -> Path:
    """The run's merged model folder, with a clear error when the run did not write one."""
    merged = run_dir / "merged"
    if not (merged / "config.json").is_file():
        raise RunDirError(
            f"{merged}: no merged model; run with merge.enabled: true (the default) and let the run finish"
        )
    return merged


def pick_gguf(run_dir: Path, name: str | None = None) -> Path:
    """The GGUF to load: `name` (a file name or a type such as q8_0), else the most precise one written."""
    folder = run_dir / "gguf"
    if not folder.is_dir():
        raise RunDirError(f"{folder}: no GGUF files; set export.gguf (e.g. [f16]) or use --backend hf")
    # Dot-files are unfinished writes; the adapter and vision projector GGUFs are not models.
    files = sorted(
        p
        for p in folder.glob("*.gguf")
        if not p.name.startswith(".") and not p.name.endswith((ADAPTER_GGUF_SUFFIX, MMPROJ_GGUF_SUFFIX))
    )
    stale = _not_produced(run_dir, files)
    files = [p for p in files if p not in stale]
    if not files:
        raise RunDirError(f"{folder}: no GGUF files of this run; set export.gguf (e.g. [f16]) or use --backend hf")
    if name is not None:
        chosen = [p for p in files if p.name == name or p.stem.endswith(f"-{name.lower()}")]
        if not chosen:
            left = [p.name for p in stale if p.name == name or p.stem.endswith(f"-{name.lower()}")]
            why = f"{left[0]} is left from an earlier run (not in this run's export.gguf)" if left else "not there"
            raise RunDirError(f"--gguf {name}: {why}; choose one of {', '.join(p.name for p in files)}")
        return chosen[0]
    rank = {t: i for i, t in enumerate(PRECISION_ORDER)}
    return min(files, key=lambda p: rank.get(p.stem.rsplit("-", 1)[-1], len(rank)))


class _LlamaBackend:
    """llama.cpp on one GGUF file, fed the HF tokenizer's ids."""

    def __init__(self, gguf_path: Path, n_ctx: int, lora_path: Path | None = None):
        from slimtune.export.gguf_quantize import require_llama_cpp
        from slimtune.export.gguf_verify import _THREADS, GGUFVerifyError, check_complete

        llama_cpp = require_llama_cpp("generating with llama.cpp (or use --backend hf)")
        try:
            check_complete(gguf_path)
        except GGUFVerifyError as e:  # a damaged file of the run directory: input, not a failure of this command
            raise RunDirError(str(e)) from None
        extra = {"lora_path": str(lora_path)} if lora_path is not None else {}
        try:
            self.llm = llama_cpp.Llama(str(gguf_path), n_ctx=n_ctx, n_threads=_THREADS, verbose=False, **extra)
        except ValueError as e:  # llama-cpp-python's "Failed to load model from file": a whole file it cannot use
            raise RunDirError(f"{gguf_path}: llama.cpp cannot load it ({e}); export it again or pick another") from None

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float) -> list[int]:
        out: list[int] = []
        for token in self.llm.generate(ids, temp=temperature, top_k=0 if temperature else 1, reset=True):
            if token == self.llm.token_eos() or len(out) >= max_new_tokens:
                break
            out.append(token)
        return out


def load_hf_model(model_dir: Path, device: str = "cpu"):
    """A transformers model for inference: float32 on the CPU (no fast 16-bit matmuls there), else as saved."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else "auto"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **text_model_load_kwargs(model_dir))
    return model.to(device).eval()  # a multimodal checkpoint: its language model (text in, text out)


class HFBackend:
    """transformers on a loaded model (the merged model, or the base for comparisons)."""

    def __init__(self, model):
        self.model = model

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float) -> list[int]:
        import torch

        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        device = next(self.model.parameters()).device
        config = self.model.config
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens,
                pad_token_id=config.pad_token_id if config.pad_token_id is not None else config.eos_token_id,
                **sampling,
            )
        return out[0, len(ids) :].tolist()


@dataclass
class Generator:
    """A model behind one backend plus the run's tokenizer: plain completions and chat turns."""

    tokenizer: Any
    backend: _Backend
    context: int  # tokens the backend can attend to: prompt + reply must fit

    def answer(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0) -> str:
        """The reply to `prompt` as one user turn when the tokenizer has a chat template, else its continuation."""
        if self.tokenizer.chat_template:
            return self.chat([{"role": "user", "content": prompt}], max_new_tokens, temperature)
        return self.complete(prompt, max_new_tokens, temperature)

    def complete(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0) -> str:
        """The continuation of `prompt` (the tokenizer adds BOS as in training)."""
        ids = self.tokenizer(prompt)["input_ids"]
        self._check_fits(ids, max_new_tokens)
        return self._run(ids, max_new_tokens, temperature)

    def chat(self, messages: list[dict[str, str]], max_new_tokens: int = 128, temperature: float = 0.0) -> str:
        """The assistant's reply to `messages`, rendered with the run's chat template."""
        if not self.tokenizer.chat_template:
            raise RunDirError(
                "the run's tokenizer has no chat template; use `slimtune generate RUN_DIR --prompt ...` "
                "for plain completions"
            )
        ids = self._render(messages)
        # The oldest exchanges go first when the conversation outgrows the context (a system turn stays).
        keep = 1 if messages[0]["role"] == "system" else 0
        while len(ids) + max_new_tokens > self.context and len(messages) > keep + 2:
            messages = messages[:keep] + messages[keep + 2 :]
            ids = self._render(messages)
        self._check_fits(ids, max_new_tokens)
        return self._run(ids, max_new_tokens, temperature)

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        return list(out["input_ids"])

    def _check_fits(self, ids: list[int], max_new_tokens: int) -> None:
        if len(ids) + max_new_tokens > self.context:
            raise PromptTooLong(
                f"the prompt is {len(ids)} tokens; with --max-new-tokens {max_new_tokens} it exceeds the "
                f"{self.context}-token context; shorten it or lower --max-new-tokens"
            )

    def _run(self, ids: list[int], max_new_tokens: int, temperature: float) -> str:
        new = self.backend.generate(ids, max_new_tokens, temperature)
        eos = self.tokenizer.eos_token_id
        if eos in new:  # the HF backend keeps the EOS it stopped on
            new = new[: new.index(eos)]
        return self.tokenizer.decode(new, skip_special_tokens=True).strip()


def open_generator(run_dir: str | Path, *, backend: str = "llama", gguf: str | None = None) -> Generator:
    """A `Generator` on a finished run: llama.cpp on its GGUF, or transformers on `merged/`.

    Raises:
        RunDirError: the run directory lacks the merged model or GGUF the backend needs.
    """
    from transformers import AutoTokenizer

    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: not a directory; give a finished run's directory (output_dir/name)")
    source = merged_dir(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if backend == "hf":
        from slimtune.core.device import resolve_device

        return Generator(
            tokenizer, HFBackend(load_hf_model(source, str(resolve_device("auto")))), model_context(source)
        )
    n_ctx = min(_MAX_CTX, model_context(source))
    return Generator(tokenizer, _LlamaBackend(pick_gguf(run_dir, gguf), n_ctx), n_ctx)


def _not_produced(run_dir: Path, files: list[Path]) -> list[Path]:
    """The GGUF files the run's own spec does not produce (`{name}-{type}.gguf` and its split shards for each
    type of export.gguf): left by an earlier run with another export list, they are never loaded by
    default. Empty when the run directory holds no spec to tell."""
    import yaml

    try:
        spec = read_run_spec(run_dir)
        stems = [f"{spec['name']}-{t}" for t in spec["export"]["gguf"]]
    except (ValueError, yaml.YAMLError, KeyError, TypeError):  # no spec (RunDirError), or not one we can read
        return []
    shard = r"(-\d{5}-of-\d{5})?"
    return [p for p in files if not any(re.fullmatch(re.escape(stem) + shard, p.stem) for stem in stems)]


def model_context(model_dir: Path) -> int:
    """The model's trained context length (max_position_embeddings), _MAX_CTX when config.json lacks it."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return int(cfg.get("max_position_embeddings") or _MAX_CTX)


def chat_loop(
    gen: Generator, lines: Iterable[str], out: IO[str], err: IO[str], *, max_new_tokens: int, temperature: float
) -> int:
    """One user turn per input line, each reply on its own line; returns the number of turns answered.

    `/reset` starts a new conversation, `/exit` (or end of input) ends it. The `> ` prompt is written
    only to a terminal, so piped output holds the replies alone; a turn too long for the context is
    reported on `err` and dropped, and the conversation goes on.
    """
    interactive = getattr(out, "isatty", lambda: False)()
    history: list[dict[str, str]] = []
    turns = 0
    if interactive:
        out.write("> ")
        out.flush()
    for line in lines:
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            history = []
        elif text:
            try:
                reply = gen.chat([*history, {"role": "user", "content": text}], max_new_tokens, temperature)
            except PromptTooLong as e:
                err.write(f"slimtune: {e}\n")
                err.flush()
            else:
                history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
                out.write(reply + "\n")
                turns += 1
        if interactive:
            out.write("> ")
        out.flush()
    return turns
