"""Shared fixtures. Any hub access during tests is a bug, so the hub is switched off first."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
# One intra-op thread: the tiny models gain nothing from more, and torch's OpenMP threads
# spin-wait so badly on a shared 2-core machine (tests starting subprocesses, several runs)
# that steps become 100x slower. Subprocesses inherit the variable.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import gc  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Where the device-relevant tests run (``--device``, or TEST_DEVICE): cpu (default, CI) or cuda.
DEVICE = "cpu"
# ``--full_matrix``: the slow matrices (every network type x kind / precision) run every case, not only the
# cases CI runs (one per distinct code path), so the suite stays short.
FULL_MATRIX = False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device", choices=("cpu", "cuda"), default=os.environ.get("TEST_DEVICE", "cpu"),
        help="cpu (default): everything on CPU, a GPU is hidden even where there is one. cuda: run only the "
             "tests marked 'device' (autocast + loss scaler, the guard's norms, trainings, sampling, kill + "
             "resume) with their tensors and trainings on CUDA.")
    parser.addoption(
        "--full_matrix", action="store_true", default=False,
        help="run every case of the slow matrices (each network type on SD 1.5 and SDXL, in fp16 and bf16); "
             "by default they run the cases of distinct code paths only")


def pytest_configure(config: pytest.Config) -> None:
    global DEVICE, FULL_MATRIX
    config.addinivalue_line("markers", "device: device-relevant; runs on CUDA with --device cuda")
    config.addinivalue_line("markers", "slow: minutes on 2 CPU cores (every network type trained or converted); "
                                       "-m 'not slow' leaves them out")
    DEVICE = config.getoption("--device")
    FULL_MATRIX = config.getoption("--full_matrix")
    if DEVICE == "cpu":
        # Before the first CUDA call, so in-process trainings and their subprocesses stay on CPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if DEVICE == "cuda":
        skip = pytest.mark.skip(reason="not device-relevant: runs with --device cpu")
        for item in items:
            if "device" not in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def imported_objects_frozen() -> None:
    """What the collected test modules imported (the trainer, torch, diffusers, transformers: ~500k objects in a
    full run) leaves the garbage collector's scans (``gc.freeze``): every training calls ``gc.collect()`` (as
    kohya's, to free the caching's models), which would scan them all, ~0.3 s of CPU each time, hundreds of times
    per worker. Objects the tests create are collected as before; the frozen ones are long-lived modules."""
    gc.collect()
    gc.freeze()


def full_matrix() -> bool:
    """Whether ``--full_matrix`` was given (read when a test module is collected, after the options)."""
    return FULL_MATRIX


@pytest.fixture
def device() -> torch.device:
    """The device of the device-relevant tests (``--device``)."""
    return torch.device(DEVICE)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SDXL, SD1.x and SD2.x built once per session (a few seconds).

    Keys: ``root``, ``tokenizers`` (kohya --tokenizer_cache_dir layout), and for
    NAME in ``sdxl``, ``sd15``, ``sd2``: NAME (diffusers folder), ``NAME_file``
    (original-layout .safetensors), ``NAME_config`` (configs + tokenizers, no
    weights; a --model_config_dir). Treat them as read-only.
    """
    from tools.build_tiny_models import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def one_image_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DreamBooth folder with one generated image (repeated 10 times per epoch)."""
    from tools.make_demo_dataset import make_demo_dataset

    root = tmp_path_factory.mktemp("one_image")
    make_demo_dataset(str(root), count=1, size=64, repeats=10)
    return root


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DreamBooth folder with four generated images and .txt captions."""
    from tools.make_demo_dataset import make_demo_dataset

    root = tmp_path_factory.mktemp("demo_dataset")
    make_demo_dataset(str(root), count=4, size=72, repeats=1)
    return root


@pytest.fixture
def offline_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """wandb in offline mode writing under ``tmp_path`` (returned: its ``wandb`` folder), no key.

    wandb reads its settings once per process (``wandb.setup``): it is torn down before and after,
    or a run would land in the folder of whichever test used wandb first in this process."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield tmp_path / "wandb"
    wandb.teardown()


# The training script of each tiny model kind (module names for ``run_trainer``).
TRAIN_SCRIPTS = {"sdxl": "sdxl_train_network", "sd15": "train_network"}


def trainings_run_once(tmp_path_factory: pytest.TempPathFactory,
                       argv_for: Callable[[str, str, Path], list[str]]) -> Callable[[str, str], Path]:
    """``get(variant, kind)`` -> the output folder of the training ``argv_for(variant, kind, folder)``
    describes, trained on first request only (for module-scoped fixtures shared by many tests)."""
    runs: dict[tuple[str, str], Path] = {}

    def get(variant: str, kind: str) -> Path:
        if (variant, kind) not in runs:
            output_dir = tmp_path_factory.mktemp(f"{variant}_{kind}")
            run_trainer(TRAIN_SCRIPTS[kind], argv_for(variant, kind, output_dir))
            runs[variant, kind] = output_dir
        return runs[variant, kind]
    return get


def model_args(tiny_models: dict[str, Path], name: str) -> list[str]:
    """Flags loading tiny model ``name`` (sdxl, sd15, sd2) from its single file, offline."""
    return [
        "--pretrained_model_name_or_path", str(tiny_models[f"{name}_file"]),
        "--model_config_dir", str(tiny_models[f"{name}_config"]),
    ]


REPO = Path(__file__).resolve().parent.parent
SCRIPT_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "SOURCE_DATE_EPOCH": "1700000000", "OMP_NUM_THREADS": "1"}
"""The environment of trainer subprocesses: offline, one thread, file times from SOURCE_DATE_EPOCH."""


def run_sdxl_script(argv: list[str], expect: int | None = 0) -> subprocess.CompletedProcess:
    """``sdxl_train_network.py argv`` in a subprocess; its exit code must be ``expect`` (None: any)."""
    result = subprocess.run([sys.executable, str(REPO / "sdxl_train_network.py"), *argv], cwd=REPO, env=SCRIPT_ENV,
                            capture_output=True, text=True, timeout=600)
    if expect is not None:
        assert result.returncode == expect, (result.stdout + result.stderr)[-3000:]
    return result


def run_trainer(script: str, argv: list[str]) -> None:
    """Run ``train_network`` or ``sdxl_train_network`` in this process (much faster than a subprocess)."""
    import importlib

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    importlib.import_module(script).main(argv=argv)
    if DEVICE == "cuda":  # the training really ran on the GPU
        assert torch.cuda.max_memory_allocated() > 0


def run_trainer_output(script: str, argv: list[str], expect: int | None = 0) -> str:
    """``run_trainer`` with what a subprocess of ``run_sdxl_script`` would see: ``SOURCE_DATE_EPOCH`` set (its
    files are byte-comparable with the subprocesses'); returns what it printed, stdout then stderr (the progress
    bar's lines), so lines of stdout start their own lines as in a subprocess's stdout. Its exit code must be
    ``expect`` (None: any). For runs that need no process of their own (not a kill): it saves a subprocess's start
    (its imports)."""
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        patch.setenv("SOURCE_DATE_EPOCH", SCRIPT_ENV["SOURCE_DATE_EPOCH"])
        try:
            run_trainer(script, argv)
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else 1
    output = stdout.getvalue() + stderr.getvalue()
    if expect is not None:
        assert code == expect, output[-3000:]
    return output


def run_script_as_main(argv: list[str], cwd: Path, expect: int | None = 0,
                       env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``argv`` (interpreter, script file, arguments) as a launch of it would run: the file as ``__main__`` (its
    ``exit_on_user_error`` and exit code), ``sys.argv``, working folder ``cwd``, ``env``'s variables, but in this
    process, without a process start (its imports: ~5-15 s of CPU each). For launches whose process is not what
    the test is about. Its exit code must be ``expect`` (None: any); stdout and stderr come back separately."""
    import contextlib
    import io
    import runpy

    from accelerate.state import AcceleratorState, GradientState

    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        patch.setattr(sys, "argv", argv[1:])
        patch.chdir(cwd)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        try:
            runpy.run_path(argv[1], run_name="__main__")
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
    result = subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())
    if expect is not None:
        assert code == expect, (result.stdout + result.stderr)[-3000:]
    return result


def train_expecting_user_error(argv: list[str], capsys, script: str = "sdxl_train_network") -> str:
    """Run a training that must stop on a user mistake: exit code 2 and one line on stderr (returned)."""
    from library.errors import exit_on_user_error

    capsys.readouterr()  # only this run's output
    with pytest.raises(SystemExit) as exited:
        exit_on_user_error(lambda: run_trainer(script, argv))
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    return error


def model_outputs(models, seed: int = 0) -> list[torch.Tensor]:
    """Every text encoder's hidden states and one UNet prediction, for fixed inputs (drawn in float32,
    given in the UNet's dtype)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = models.unet.dtype
    ids = torch.randint(0, 500, (2, 6), generator=generator)
    results = [encoder(ids).last_hidden_state for encoder in models.text_encoders]
    context = torch.randn(2, 6, models.unet.config.cross_attention_dim, generator=generator).to(dtype)
    latents = torch.randn(2, 4, 8, 8, generator=generator).to(dtype)
    extra = {}
    if models.is_sdxl:
        extra["added_cond_kwargs"] = {"text_embeds": torch.randn(2, 64, generator=generator).to(dtype),
                                      "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2, dtype=dtype)}
    results.append(models.unet(latents, torch.tensor([10, 500]), context, **extra).sample)
    return results


def merge_rounding_bound(dtype: torch.dtype) -> float:
    """Largest difference, relative to the network's effect, between a network merged into the weights
    and the same network applied as a separate output, computed in ``dtype``: sqrt(eps).

    The two are the same function and differ by rounding only, which the tiny random UNets amplify
    up to ~1e5 x eps (float32: 9e-4 of a 1.3 effect on AMD EPYC, 4e-3 on Intel Xeon, for sd15
    lora_fa; float64: 2e-11). So comparisons run in float64, where sqrt(eps) = 1.5e-8 leaves a
    factor of ~1e3 over that on any CPU, while a merge error (a wrong scale, a missed or misplaced
    module) is a relative error of the effect itself.
    """
    return torch.finfo(dtype).eps ** 0.5


def cast_models(models, dtype: torch.dtype):
    """``models`` with the UNet and text encoders in ``dtype`` (in place; float64: rounding-free comparisons)."""
    for model in [models.unet, *models.text_encoders]:
        model.to(dtype)
    return models


def _forked_training(script: str, argv: list[str], output_fd: int) -> None:
    """The child of ``ForkedTraining``: stdout and stderr into the pipe, the subprocess environment, the run."""
    import io

    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(output_fd)
    # the test's sys.stdout / sys.stderr are pytest's captures: the child's own descriptors instead
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    os.environ["SOURCE_DATE_EPOCH"] = SCRIPT_ENV["SOURCE_DATE_EPOCH"]
    os.chdir(REPO)
    run_trainer(script, argv)


class ForkedTraining:
    """``script``'s ``main(argv)`` in a child forked from the test's process: a process of its own to kill (kill -9
    and resume tests) without a process start, since the child has the test's imports (a subprocess spends ~5-8 s
    of CPU importing torch, diffusers and the trainer). As ``subprocess.Popen`` of ``script``'s file with
    ``stdout=PIPE, stderr=STDOUT, text=True``: ``stdout`` (lines), ``send_signal``, ``communicate``,
    ``returncode`` (-N when signal N ended it)."""

    def __init__(self, script: str, argv: list[str]) -> None:
        import multiprocessing

        read_fd, write_fd = os.pipe()
        self._process = multiprocessing.get_context("fork").Process(target=_forked_training,
                                                                    args=(script, argv, write_fd))
        self._process.start()
        os.close(write_fd)  # the child holds the only writer: the pipe ends when the child does
        self.stdout = os.fdopen(read_fd, "r")

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self._process.pid, signum)

    def communicate(self, timeout: float) -> tuple[str, None]:
        """The rest of the output once the child ended (killed after ``timeout`` s: TimeoutExpired)."""
        import threading

        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.append(self.stdout.read()), daemon=True)
        reader.start()  # the child may write more than a pipe holds before it ends
        self._process.join(timeout)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        reader.join()
        self.stdout.close()
        return rest[0], None


def start_training_process(script: str, argv: list[str]) -> "ForkedTraining | subprocess.Popen":
    """A training in a process of its own (to kill or interrupt): forked from this one (``ForkedTraining``), or on
    CUDA a subprocess of ``script``'s file (a forked child cannot use the CUDA the test's process set up)."""
    if DEVICE == "cuda":
        return subprocess.Popen([sys.executable, str(REPO / f"{script}.py"), *argv], cwd=REPO, env=SCRIPT_ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return ForkedTraining(script, argv)


def run_training_process(script: str, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``start_training_process`` to its end: returncode and output (stdout then stderr, interleaved as written)."""
    process = start_training_process(script, argv)
    output, _ = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess([script, *argv], process.returncode, output, "")
