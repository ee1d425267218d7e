"""What the experiment trackers get beyond Trainer's own logging: the spec and the run's results.

Trainer's MLflow callback ends its run in `on_train_end`, but the final evaluation runs after training, so
MLflow's `eval_loss` held only the step-0 value (the base model's loss) as the result, and the report and
the adapter card do not exist before then. `MLflowRun` keeps the run open until `close`, logs the spec's
LoRA, data, train and quantization settings as params, and attaches the report and the card as artifacts.
Trainer's W&B callback keeps its run open (W&B finishes it at exit), so it gets the final evaluation, but neither
the spec nor the files: `WandbRun` adds them and finishes the run in `close`. (TensorBoard's callback re-opens
its writer for a log after training, so it gets the final evaluation too.)
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import MLflowCallback, WandbCallback

from slimtune.merge.nf4 import TRAINING_NF4
from slimtune.spec.schema import PipelineSpec

# MLflow 3 stores a param value of up to 6,000 characters; a long data.sources list is cut well below that
_MAX_PARAM_CHARS = 1000


def tracker_params(spec: PipelineSpec, compute_dtype: str) -> dict[str, str]:
    """The spec as flat params: "lora.r", "data.max_seq_length", "train.learning_rate", "quantization.quant_type"."""
    sections = {
        "model.name_or_path": spec.model.name_or_path,
        **{f"{name}.{k}": v for name in ("lora", "data", "train") for k, v in _dump(getattr(spec, name)).items()},
        **{f"quantization.{k}": v for k, v in TRAINING_NF4.as_json().items()},
        "quantization.compute_dtype": compute_dtype,
    }
    return {key: _text(value) for key, value in sections.items()}


def _dump(section) -> dict:
    return section.model_dump(mode="json")


def _text(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _MAX_PARAM_CHARS else text[: _MAX_PARAM_CHARS - 3] + "..."


class MLflowRun(MLflowCallback):
    """Trainer's MLflow callback, with the spec as params and the run kept open until `close`.

    Args:
        params: logged once the run starts (`tracker_params`).
        artifact_root: where a local (SQLite) store keeps the artifacts of an experiment this creates; MLflow's
            default is ./mlruns of the working directory.
    """

    def __init__(self, params: Mapping[str, str], artifact_root: Path | None = None):
        super().__init__()
        self.params = dict(params)
        self.artifact_root = artifact_root
        self._uri: str | None = None

    def setup(self, args: TrainingArguments, state: TrainerState, model) -> None:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")  # Trainer's setup selects it, creating it if need be
        local = self._ml_flow.get_tracking_uri().startswith("sqlite:")
        if state.is_world_process_zero and name and local and self.artifact_root is not None:
            if self._ml_flow.get_experiment_by_name(name) is None:
                self._ml_flow.create_experiment(name, artifact_location=self.artifact_root.resolve().as_uri())
        super().setup(args, state, model)
        if state.is_world_process_zero:
            # the run's store: `_offline_trackers` sets it through the environment only while Trainer runs
            self._uri = self._ml_flow.get_tracking_uri()
            if self.params:
                self._ml_flow.log_params(self.params)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        """Nothing: the final evaluation comes after training; `close` ends the run."""

    def close(self, artifacts: Sequence[Path] = ()) -> None:
        """Attach `artifacts` (files) to the run and end it, unless the user's code had started the run (then
        they end it); does nothing on ranks other than 0, which log nothing."""
        if not (self._initialized and self._ml_flow.active_run() and self._uri):
            return
        saved = os.environ.get("MLFLOW_TRACKING_URI")
        os.environ["MLFLOW_TRACKING_URI"] = self._uri
        try:
            for path in artifacts:
                if Path(path).is_file():
                    self._ml_flow.log_artifact(str(path))
            if self._auto_end_run:
                self._ml_flow.end_run()
        finally:
            if saved is None:
                os.environ.pop("MLFLOW_TRACKING_URI")
            else:
                os.environ["MLFLOW_TRACKING_URI"] = saved


class WandbRun(WandbCallback):
    """Trainer's W&B callback, with the spec as params (the run's config) and the report and the card as an
    artifact logged by `close`, which finishes the run.

    Args:
        params: added to the run's config once the run starts (`tracker_params`).
    """

    def __init__(self, params: Mapping[str, str]):
        super().__init__()
        self.params = dict(params)
        self._rank_zero = False  # set up on the process that logs (other ranks log nothing)
        self._run = None  # the run this callback started; a run the user's code started is theirs to finish

    def setup(self, args: TrainingArguments, state: TrainerState, model, **kwargs) -> None:
        started_here = self._wandb.run is None
        super().setup(args, state, model, **kwargs)
        if state.is_world_process_zero:  # other ranks start no run
            self._rank_zero = True
            if self.params:
                self._wandb.config.update(self.params, allow_val_change=True)
            self._run = self._wandb.run if started_here else None

    def close(self, artifacts: Sequence[Path] = ()) -> None:
        """Log `artifacts` (files) as one "results" artifact of the run and finish the run; does nothing on ranks
        other than 0, which log nothing."""
        run = self._wandb.run
        if not self._rank_zero or run is None:
            return
        files = [Path(p) for p in artifacts if Path(p).is_file()]
        if files:
            artifact = self._wandb.Artifact(f"results-{run.id}", type="results")
            for path in files:
                # "immutable": no staging copy under ~/.local/share/wandb; the files stay in the run directory,
                # which an offline run's `wandb sync` reads anyway
                artifact.add_file(str(path), policy="immutable")
            run.log_artifact(artifact)
        if run is self._run:
            run.finish()


@contextlib.contextmanager
def offline_trackers(report_to: list[str], run_dir: Path) -> Iterator[None]:
    """Point the trackers Trainer reports to at the run directory, offline, unless the user's environment
    already configures them; restored afterwards. Trainer's integrations read only these variables:
    TensorBoard its `TENSORBOARD_LOGGING_DIR`, MLflow `MLFLOW_TRACKING_URI` (else ./mlruns in the cwd),
    W&B `WANDB_MODE`/`WANDB_DIR`/`WANDB_PROJECT` (offline: W&B neither logs in nor connects; `wandb sync
    <run dir>/wandb/offline-run-*` uploads the run later)."""
    wanted = {
        "tensorboard": {"TENSORBOARD_LOGGING_DIR": str(run_dir / "tensorboard")},
        # MLflow 3 refuses its file store by default (maintenance mode); SQLite is its local store now.
        "mlflow": {
            "MLFLOW_TRACKING_URI": f"sqlite:///{(run_dir / 'mlflow.db').resolve()}",
            "MLFLOW_EXPERIMENT_NAME": "slimtune",  # `MLflowRun` creates it with its artifacts in the run dir
        },
        # Offline stops W&B's login and uploads; its wandb-core service reports its own errors to Sentry unless
        # WANDB_ERROR_REPORTING is false. WANDB_SILENT: no "wandb: ..." banner lines in the run's output.
        "wandb": {
            "WANDB_MODE": "offline",
            "WANDB_DIR": str(run_dir),
            "WANDB_PROJECT": "slimtune",
            "WANDB_ERROR_REPORTING": "false",
            "WANDB_SILENT": "true",
        },
    }
    added = {k: v for name in report_to for k, v in wanted[name].items() if k not in os.environ}
    # mlflow.set_experiment (called by Trainer's setup) exports the experiment's id to the environment, wandb.init
    # the address of its wandb-core service (for child processes; this process keeps its own connection)
    exported = [key for key in ("MLFLOW_EXPERIMENT_ID", "WANDB_SERVICE") if key not in os.environ]
    os.environ.update(added)
    try:
        yield
    finally:
        for key in [*added, *exported]:
            os.environ.pop(key, None)
