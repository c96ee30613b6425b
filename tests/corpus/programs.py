"""The acceptance corpus: well-known public training programs, run unchanged as hpoflow command trials.

Each ``Program`` names a file inside a pinned registry archive (``tests/corpus/sources.py``), the sha256
of that file (checked before every run: the program is run as published), the runtime packages and
stand-in data it needs (``tests/corpus/standins.py``), its command line with ``${param}`` placeholders and
tiny sizes, the study metric and, where the program prints its own format, ``training.metrics``
patterns. ``CANDIDATES`` lists every program looked at and not in the corpus, with the reason.

``prepare(program, workdir)`` fetches what the program needs (``Unavailable`` says why it cannot be had),
``spec(...)`` writes the study for one mode, ``run(...)`` runs it with ``hpoflow run`` and reads the run's
outcome. tests/corpus/test_corpus.py runs a few programs x modes; bench/corpus.py runs all of them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.corpus import sources, standins
from tests.corpus.sources import Unavailable

ROOT = Path(__file__).resolve().parents[2]
NUM = r"(?:[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan)"

# What PyPI's torchvision is on a CPU build of torch (the MNIST programs' reason when it cannot be imported)
TORCHVISION_NOTE = ("PyPI has only the CUDA build of torchvision 0.28.0 for Linux (the CPU build is on "
                    "download.pytorch.org, which CI cannot reach), and it does not import beside torch's CPU build")


@dataclass(frozen=True)
class Program:
    """One corpus program. ``argv`` follows ``python SCRIPT``; in it ``@DATA@`` is the stand-in folder (a
    per-run copy), ``@EPOCHS@`` the program's own length option's value; ``${param}`` is hpoflow's."""

    key: str
    title: str
    archive: str  # key of sources.ARCHIVES
    path: str  # the program's file inside the unpacked archive
    sha256: str  # of that file
    argv: tuple[str, ...]
    space: dict[str, Any]
    metric: str
    direction: str
    epochs: int  # the program's length option (@EPOCHS@): epochs, episodes, ...
    steps: int  # reports one full run makes (training.epochs under a scheduler)
    expect: tuple[int, ...]  # the steps a trial that runs to its end reports (1 rank)
    patterns: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()  # sources.GROUPS it imports
    path_archives: tuple[str, ...] = ()  # further archives put on PYTHONPATH (torchvision)
    import_root: bool = True  # the archive's folder on PYTHONPATH (an sdist's package: opacus, ignite)
    standin: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # extra environment (``@DATA@`` replaced)
    probe: tuple[str, ...] = ()  # modules that must import beside torch, else the program is Unavailable
    distributed: bool = False  # it runs as several ranks from torchrun's environment
    data_in_workdir: bool = False  # it reads its data from its working directory: the stand-in is copied into
    # the directory hpoflow runs in, and the trials run there (training.workdir: ".")
    cpus: int = 1  # resources.cpus_per_process
    min_resource: int = 1  # ASHA's first rung (in the program's steps)
    expect_2: tuple[int, ...] = ()  # the same for 2 ranks, where it differs
    reads: str = ""  # why hpoflow cannot read its metrics ("" when it can): the trial is expected to fail
    does: str = ""  # what it exercises, for docs/corpus.md and the bench's table


PROGRAMS: tuple[Program, ...] = (
    Program(
        key="opacus-char-lstm", title="Opacus char-LSTM name classification (DP-SGD)", archive="opacus",
        path="examples/char-lstm-classification.py",
        sha256="f834ae1453c2c1b567e475518f1484db601878be9a72a15306591acf675d774d",
        argv=("--data-root", "@DATA@/names", "--device", "cpu", "-b", "64", "--epochs", "@EPOCHS@",
              "--learning-rate", "${lr}", "--hidden-size", "16", "--embedding-size", "8"),
        space={"lr": {"type": "float", "low": 0.5, "high": 4.0, "log": True}},
        metric="train_loss", direction="minimize", epochs=3, steps=3, expect=(0, 1, 2),
        # '\t Epoch 0. Accuracy: 0.331684 | Loss: 1.420902 | (ε = 4.54, δ = 8e-05)'; epochs count from 0
        patterns=(rf"Epoch (?P<epoch>\d+)\. Accuracy: (?P<train_accuracy>{NUM}) \| Loss: (?P<train_loss>{NUM})",),
        groups=("opacus",), standin="names",
        does="DataLoader(num_workers=1) on every epoch; tqdm bars; writes run_results_chr_lstm_classification.pt "
             "in its working directory"),
    Program(
        key="opacus-imdb", title="Opacus IMDB sentiment (DP-SGD, Hugging Face datasets and tokenizer)",
        archive="opacus", path="examples/imdb.py",
        sha256="cfb2e01e0d4e311b983401db31c7f8301d6a80b970785eb35e351086ff54604f",
        argv=("--data-root", "@DATA@/imdb", "--device", "cpu", "-b", "16", "-n", "@EPOCHS@", "--lr", "${lr}",
              "--max-sequence-length", "32", "-j", "2"),
        space={"lr": {"type": "float", "low": 0.005, "high": 0.1, "log": True}},
        metric="val_loss", direction="minimize", epochs=3, steps=3, expect=(1, 2, 3),
        # '\nTest set: Average loss: 0.6884, Accuracy: 40.62%\n' after each epoch, without its number
        patterns=(rf"Test set: Average loss: (?P<val_loss>{NUM}),",),
        groups=("opacus", "datasets"), standin="imdb", env=(("HF_HUB_CACHE", "@DATA@/hub"),),
        does="DataLoader(num_workers=2); load_dataset('imdb') and BertTokenizerFast.from_pretrained"
             "('bert-base-cased') offline from stand-in caches; a metric line without a step; writes "
             "run_results_imdb_classification.pt in its working directory"),
    Program(
        key="ignite-reinforce", title="PyTorch-Ignite REINFORCE on CartPole (port of pytorch/examples)",
        archive="pytorch-ignite", path="examples/reinforcement_learning/reinforce.py",
        sha256="b589870c9852058736ba5d774852bfc4ca3a7ae03e75aeffabe361d9df06b680",
        argv=("--max-episodes", "@EPOCHS@", "--log-interval", "5", "--gamma", "${gamma}"),
        space={"gamma": {"type": "float", "low": 0.9, "high": 0.999}},
        metric="running_reward", direction="maximize", epochs=40, steps=40, min_resource=20,
        expect=tuple(range(5, 41, 5)),
        # 'Episode 10\tLast reward: 34.00\tAverage length: 18.80' every 5 episodes
        patterns=(rf"Episode (?P<step>\d+)\s+Last reward: {NUM}\s+Average length: (?P<running_reward>{NUM})",),
        groups=("gym",),
        does="gymnasium's CartPole-v1 (no data); an Ignite Engine whose epochs are episodes"),
    Program(
        key="ignite-actor-critic", title="PyTorch-Ignite actor-critic on CartPole (port of pytorch/examples)",
        archive="pytorch-ignite", path="examples/reinforcement_learning/actor_critic.py",
        sha256="fbde94f8394cde54b609ef3c382ed7a446a069908d6b8883d399c5d3b7bb77e2",
        argv=("--max-episodes", "@EPOCHS@", "--log-interval", "5", "--gamma", "${gamma}"),
        space={"gamma": {"type": "float", "low": 0.9, "high": 0.999}},
        metric="running_reward", direction="maximize", epochs=40, steps=40, min_resource=20,
        expect=tuple(range(5, 41, 5)),
        patterns=(rf"Episode (?P<step>\d+)\s+Last reward: {NUM}\s+Average reward: (?P<running_reward>{NUM})",),
        groups=("gym",),
        does="gymnasium's CartPole-v1 (no data)"),
    Program(
        key="trl-sft", title="TRL's SFT script (Hugging Face Trainer, eval_steps)", archive="trl",
        path="trl/scripts/sft.py", sha256="310f4eb5f750a8f2f1ca9ef86235455a6d1d262d1c4cf6c8261ad95090a209dc",
        argv=("--model_name_or_path", "@DATA@/model", "--dataset_name", "@DATA@/data", "--learning_rate", "${lr}",
              "--num_train_epochs", "@EPOCHS@", "--per_device_train_batch_size", "8", "--eval_strategy", "steps",
              "--eval_steps", "5", "--logging_steps", "5", "--save_strategy", "no", "--output_dir", "sft-out",
              "--report_to", "none", "--max_length", "32", "--dataloader_num_workers", "2", "--use_cpu",
              "--seed", "0"),
        space={"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        metric="eval_loss", direction="minimize", epochs=2, steps=4, min_resource=2,
        expect=(1, 2, 3, 4), expect_2=(1, 2),  # 80 rows, 8 a rank: 20 (10) optimizer steps, eval every 5
        # "{'eval_loss': '2.99', 'eval_runtime': '0.4173', ..., 'epoch': '0.5'}" (transformers 5 quotes the
        # values) after every 5 optimizer steps: no step on the line (epoch 0.5 is not a whole number)
        patterns=(rf"'eval_loss': '?(?P<eval_loss>{NUM})'?",),
        groups=("datasets",), standin="sft", distributed=True,
        does="transformers.Trainer (TRL's SFTTrainer) with eval_steps and DataLoader(num_workers=2); its own "
             "DDP (gloo) from torchrun's environment; tqdm bars redrawn with \\r; writes sft-out/ in its "
             "working directory"),
    Program(
        key="trl-dpo", title="TRL's DPO script (Hugging Face Trainer, eval_steps, the default reader)", archive="trl",
        path="trl/scripts/dpo.py", sha256="faf93f88277ddb87d6f47f046756527f0c59071096f81545d249eb9fc4639d36",
        argv=("--model_name_or_path", "@DATA@/model", "--dataset_name", "@DATA@/prefs", "--learning_rate", "${lr}",
              "--max_steps", "@EPOCHS@", "--per_device_train_batch_size", "8", "--eval_strategy", "steps",
              "--eval_steps", "5", "--logging_steps", "5", "--save_strategy", "no", "--output_dir", "dpo-out",
              "--report_to", "none", "--max_length", "32", "--dataloader_num_workers", "2", "--use_cpu",
              "--seed", "0"),
        space={"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        # no pattern: hpoflow's own reader, on "{'eval_loss': '0.6636', ..., 'eval_rewards/margins': '0.0601',
        # ..., 'epoch': '0.625'}" (transformers 5 prints the values quoted). 64 pairs, 8 a rank: 8 (4) steps an
        # epoch; 15 steps with an evaluation every 5 (the last one is the Trainer's end-of-training one) put no
        # evaluation on a whole epoch, at 1 or 2 ranks, so no line has a step: the evaluations are steps 1, 2, 3
        metric="eval_rewards/margins", direction="maximize", epochs=15, steps=3, expect=(1, 2, 3),
        groups=("datasets",), standin="sft", distributed=True,
        does="TRL's DPOTrainer (a Trainer) with a reference model, eval_steps and DataLoader(num_workers=2); "
             "its metric read by hpoflow's default reader from the printed dict ('/' in the name, quoted values)"),
    Program(
        key="ignite-transformers", title="PyTorch-Ignite IMDB fine-tuning (ignite.distributed, Fire CLI)",
        archive="pytorch-ignite", path="examples/transformers/main.py",
        sha256="5b33f88ac8968085a66d19c432b223dae3ea97f503f93aa52fc57eaf863b2bfb",
        argv=("run", "--model=@DATA@/tinybert", "--data_dir=@DATA@/imdb", "--output_dir=ignite-out",
              "--num_workers=2", "--num_epochs=@EPOCHS@", "--batch_size=8", "--max_length=32", "--n_fc=16",
              "--learning_rate=${lr}", "--log_every_iters=0", "--backend=gloo"),
        space={"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        metric="val_accuracy", direction="maximize", epochs=2, steps=2, expect=(),
        patterns=(rf"^\s*Accuracy: (?P<val_accuracy>{NUM})$",),
        groups=("datasets", "fire"), standin="imdb", distributed=True,
        reads="it logs its metrics with the logging module, on stderr, each value on a line of its own after "
              "a 'Train metrics:' or 'Test metrics:' line; hpoflow reads rank 0's stdout one line at a time, "
              "so the trial ends with no report (the program itself runs to its end)",
        does="idist.Parallel: gloo from torchrun's environment (2 ranks); idist.auto_dataloader with "
             "num_workers=2; rank 0 writes TensorBoard logs and checkpoints under ignite-out/"),
    Program(
        key="ignite-transformers-spawn", title="PyTorch-Ignite IMDB fine-tuning, spawning its own 2 processes",
        archive="pytorch-ignite", path="examples/transformers/main.py",
        sha256="5b33f88ac8968085a66d19c432b223dae3ea97f503f93aa52fc57eaf863b2bfb",
        argv=("run", "--model=@DATA@/tinybert", "--data_dir=@DATA@/imdb", "--output_dir=ignite-out",
              "--num_workers=2", "--num_epochs=@EPOCHS@", "--batch_size=8", "--max_length=32", "--n_fc=16",
              "--learning_rate=${lr}", "--log_every_iters=0", "--backend=gloo", "--nproc_per_node=2"),
        space={"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        metric="val_accuracy", direction="maximize", epochs=2, steps=2, expect=(),
        patterns=(rf"^\s*Accuracy: (?P<val_accuracy>{NUM})$",),
        groups=("datasets", "fire"), standin="imdb", cpus=2,
        reads="as ignite-transformers: its metrics are logged on stderr, one value a line",
        does="a 1-rank trial whose program starts 2 processes itself (idist.Parallel(nproc_per_node=2): "
             "torch.multiprocessing's spawn, as pytorch/examples' mnist_hogwild starts its own), each with "
             "DataLoader(num_workers=2) and gloo"),
    Program(
        key="opacus-mnist", title="Opacus MNIST (DP-SGD, torchvision)", archive="opacus",
        path="examples/mnist.py", sha256="14e9a51180f52ea05029e803f0ab8a172910142cf256ba0e24be15011b1fbcf7",
        argv=("--data-root", "@DATA@", "--device", "cpu", "-b", "64", "--test-batch-size", "128", "-n",
              "@EPOCHS@", "--lr", "${lr}"),
        space={"lr": {"type": "float", "low": 0.02, "high": 0.5, "log": True}},
        metric="train_loss", direction="minimize", epochs=2, steps=2, expect=(1, 2),
        patterns=(rf"Train Epoch: (?P<epoch>\d+)\s+Loss: (?P<train_loss>{NUM})",),
        groups=("opacus",), path_archives=("torchvision",), standin="mnist", probe=("torchvision",),
        does="torchvision.datasets.MNIST(download=True) finding the stand-in idx files; writes run_results_*.pt"),
    Program(
        key="ignite-mnist", title="PyTorch-Ignite MNIST (torchvision)", archive="pytorch-ignite",
        path="examples/mnist/mnist.py", sha256="830fca7d5b580118b3b8e5a9f1599da376eb96b8a0f302288f2533d41c6452f8",
        argv=("--batch_size", "64", "--val_batch_size", "128", "--epochs", "@EPOCHS@", "--lr", "${lr}",
              "--log_interval", "4"),
        space={"lr": {"type": "float", "low": 0.005, "high": 0.1, "log": True}},
        metric="val_loss", direction="minimize", epochs=2, steps=2, expect=(1, 2),
        patterns=(rf"Validation Results - Epoch: (?P<epoch>\d+)\s+Avg accuracy: (?P<val_accuracy>{NUM})\s+"
                  rf"Avg loss: (?P<val_loss>{NUM})",),
        path_archives=("torchvision",), standin="mnist", probe=("torchvision",), data_in_workdir=True,
        does="MNIST(root='.', download=True): the stand-in in its working directory; tqdm.write lines"),
)

BY_KEY = {p.key: p for p in PROGRAMS}

# Every candidate looked at and not in PROGRAMS: (program, where it was looked for, why it is not run).
CANDIDATES: tuple[tuple[str, str, str], ...] = (
    ("pytorch/examples mnist, mnist_hogwild, word_language_model, imagenet",
     "PyPI (package list), Debian (apt-cache search pytorch/torch), npm",
     "not distributed through any package registry (only on GitHub, which CI cannot reach)"),
    ("accelerate examples/nlp_example.py, cv_example.py", "PyPI sdist accelerate-1.15.0.tar.gz",
     "the sdist carries no examples/ folder (only src/ and tests/)"),
    ("transformers examples/pytorch/* (run_glue.py, run_clm.py)", "PyPI sdist transformers-5.24.0.tar.gz",
     "the sdist carries only src/ and tests/; TRL's sft.py stands in as the Trainer program"),
    ("Lightning examples (examples/pytorch/*)", "PyPI sdists lightning-2.6.6, pytorch_lightning-2.6.6",
     "neither sdist carries examples/; the wheels' lightning.pytorch.demos have no entry point"),
    ("timm train.py", "PyPI sdist timm-1.0.31.tar.gz", "the sdist carries only timm/ and tests/"),
    ("torchvision references/classification/train.py", "PyPI torchvision",
     "no sdist on PyPI (wheels only), so no references/ folder"),
    ("horovod examples/pytorch/pytorch_mnist.py", "PyPI sdist horovod-0.28.1.tar.gz", "the sdist has no examples/"),
    ("skorch examples", "PyPI sdist skorch-1.4.0", "the sdist has no examples/"),
    ("torchtnt examples", "PyPI torchtnt-0.2.4", "no sdist on PyPI; the wheel has no examples"),
    ("opacus examples/mnist_lightning.py (Lightning with DataLoader workers)", "PyPI sdist opacus-1.6.0",
     "imports pytorch_lightning.utilities.cli.LightningCLI (removed in Lightning 2.0) and pl_bolts; needs "
     "torchvision"),
    ("opacus examples/fsdp_example.py, tensor_parallelism_toy.py", "PyPI sdist opacus-1.6.0",
     "GPU only: world size torch.cuda.device_count(), NCCL, torch.cuda.set_device; fsdp_example needs torchvision"),
    ("opacus examples/cifar10.py, dcgan.py", "PyPI sdist opacus-1.6.0",
     "torchvision's CIFAR10 checks the md5 of the real archive's files (no stand-in can pass), and "
     "torchvision (see opacus-mnist)"),
    ("pytorch-ignite examples/cifar10/main.py (2-rank idist)", "PyPI sdist pytorch_ignite-0.5.5",
     "torchvision's CIFAR10 checks the md5 of the real files, so no stand-in can be given; and torchvision"),
    ("pytorch-ignite examples/gan, super_resolution, siamese_network, fast_neural_style",
     "PyPI sdist pytorch_ignite-0.5.5", "torchvision data sets (CIFAR10, BSDS300, ...) that verify md5 or download"),
    ("pytorch-accelerated examples/core/train_mnist.py", "PyPI sdist pytorch_accelerated-0.1.61",
     "no command-line options (learning rate and epochs fixed in the code: nothing to tune without editing "
     "it); random_split(dataset, [50000, 5000, 5000]) needs the full 60,000-image MNIST; data under the "
     "archive's own folder; torchvision"),
    ("poutyne examples/basic_random_*.py", "PyPI sdist poutyne-1.19.0",
     "no command-line options: nothing to tune without editing the program"),
    ("torchx examples/apps/lightning/train.py", "PyPI wheel torchx-0.7.0",
     "downloads its data with fsspec from a URL (--data_path), and torchvision"),
    ("litgpt pretrain / finetune (Lightning Fabric)", "PyPI litgpt-0.5.13",
     "needs huggingface_hub 1.x, while the environment's transformers 5.24 needs 2.x; not pursued"),
)


@dataclass
class Prepared:
    program: Program
    script: Path
    pythonpath: list[Path]
    data: Path | None  # this run's copy of the stand-in
    env: dict[str, str] = field(default_factory=dict)


def _probe(modules: tuple[str, ...], pythonpath: list[Path]) -> None:
    if not modules:
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    code = "import torch\n" + "".join(f"import {m}\n" for m in modules)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        note = f" ({TORCHVISION_NOTE})" if "torchvision" in modules else ""
        raise Unavailable(f"{', '.join(modules)} cannot be imported beside torch: {last}{note}")


def prepare(program: Program, workdir: Path) -> Prepared:
    """Everything ``program`` needs, fetched or made (``Unavailable`` when something cannot be had): the
    script (checked against its sha256), ``PYTHONPATH``, a copy of the stand-in data under ``workdir``
    (or in it, for a program that reads its working directory) and the trials' environment."""
    root = sources.source(program.archive)
    script = root / program.path
    if not script.is_file():
        raise Unavailable(f"{program.path} is not in {sources.ARCHIVES[program.archive].filename}")
    digest = sources.sha256_of(script)
    if digest != program.sha256:
        raise Unavailable(f"{script} has sha256 {digest}, not the pinned {program.sha256}: not the published program")
    path = [root] if program.import_root else []
    path += [sources.group(g) for g in program.groups]
    path += [sources.source(a) for a in program.path_archives]
    _probe(program.probe, path)
    data = None
    workdir.mkdir(parents=True, exist_ok=True)
    if program.standin:
        made = standins.make(program.standin, path)
        data = workdir if program.data_in_workdir else workdir / "data"
        shutil.copytree(made, data, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".hpoflow-corpus-ok"))
    env = {k: v.replace("@DATA@", str(data)) for k, v in program.env}
    return Prepared(program, script, path, data, env)


@dataclass(frozen=True)
class Mode:
    """One way to run a program's study."""

    isolate: bool = False
    ranks: int = 1
    search: str = "pruner"  # pruner (median) | asha (promotion) | plain (neither)
    n_trials: int = 3
    max_concurrent: int = 1

    @property
    def label(self) -> str:
        return (f"{'isolated' if self.isolate else 'warm'} {self.ranks}r {self.search}"
                + (f" x{self.max_concurrent}" if self.max_concurrent > 1 else ""))


def spec(prep: Prepared, mode: Mode, name: str) -> dict[str, Any]:
    """The study of ``prep``'s program in ``mode``: its command unchanged but for ``${param}`` values."""
    p = prep.program
    argv = [a.replace("@DATA@", str(prep.data)).replace("@EPOCHS@", str(p.epochs)) for a in p.argv]
    training: dict[str, Any] = {"command": ["python", str(prep.script), *argv], "stop_grace_s": 1}
    if p.patterns:
        training["metrics"] = list(p.patterns)
    if mode.isolate:
        training["isolate"] = True
    if p.data_in_workdir:
        training["workdir"] = "."  # where its stand-in is (by default a trial runs in its own directory)
    search: dict[str, Any] = {"algorithm": "random", "n_trials": mode.n_trials, "max_concurrent": mode.max_concurrent,
                              "seed": 0}
    if mode.search == "pruner":
        search["pruner"] = {"type": "median", "startup_trials": 1}
    elif mode.search == "asha":
        search["scheduler"] = {"type": "asha", "min_resource": p.min_resource, "reduction_factor": 3,
                              "anchor": "min"}  # the rung the program is chosen for: min_resource itself
        training["epochs"] = p.steps
    return {"study": {"name": name, "metric": p.metric, "direction": p.direction}, "space": dict(p.space),
            "search": search, "training": training, "resources": {"processes": mode.ranks, "cpus_per_process": p.cpus}}


@dataclass
class Outcome:
    rc: int
    wall_s: float
    summary: dict[str, Any]  # hpoflow run --json
    trials: list[dict[str, str]]  # trials.csv
    run_dir: Path
    stderr: str

    def states(self) -> list[str]:
        return [t["state"] for t in self.trials]

    def errors(self) -> list[str]:
        return [t.get("error", "") for t in self.trials if t.get("error")]

    def log(self, trial: int, rank: int = 0) -> str:
        f = self.run_dir / "trials" / str(trial) / f"rank{rank}.log"
        return f.read_text(errors="replace") if f.exists() else ""

    def cause(self) -> str:
        """The first trial error, cut to its last lines (the cause), or the driver's stderr."""
        for e in self.errors():
            return " | ".join(ln.strip() for ln in e.strip().splitlines()[-4:])
        return " | ".join(self.stderr.strip().splitlines()[-4:])


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s session and every descendant (the programs run in process groups of their own)."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        kids = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.kill()


def run(prep: Prepared, mode: Mode, workdir: Path, name: str, timeout_s: float = 600.0) -> Outcome:
    """``hpoflow run`` of ``spec(prep, mode)``, started in ``workdir`` (each trial's program runs in its trial
    directory, ``training.workdir``'s default, but for a program that reads its working directory),
    offline: Hugging Face's offline switches, and HTTP(S) proxies that refuse every connection. A study
    that has not ended after ``timeout_s`` is killed with its workers and programs (``rc`` 124)."""
    data = spec(prep, mode, name)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file = workdir / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = workdir / f"{name}-run"
    tests = ROOT / "tests"
    env = {**os.environ, **standins.OFFLINE_ENV, "HF_HOME": str(workdir / ".hf-home"),
           "MPLCONFIGDIR": str(workdir / ".mpl"), **prep.env,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tests), *map(str, prep.pythonpath)])}
    t0 = time.monotonic()
    # a session of its own: on a timeout the driver, its workers and the programs are killed at once
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow", "run", str(spec_file), "--run-dir", str(run_dir),
                             "--json"], env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, err = proc.communicate()
        rc = 124
        err += f"\nhpoflow run did not end in {timeout_s:.0f} s (killed)"
    except BaseException:
        _kill_tree(proc.pid)
        proc.communicate()
        raise
    wall = time.monotonic() - t0
    summary: dict[str, Any] = {}
    for line in reversed(out.strip().splitlines()):
        try:
            summary = json.loads(line)
            break
        except ValueError:
            continue
    trials: list[dict[str, str]] = []
    if (run_dir / "trials.csv").exists():
        with (run_dir / "trials.csv").open(newline="") as f:
            trials = list(csv.DictReader(f))
    return Outcome(rc, wall, summary, trials, run_dir, err)


def reported_steps(outcome: Outcome, trial: int) -> list[int]:
    """The steps trial ``trial`` reported, from the study's storage (each step once, in order)."""
    import optuna

    from hpoflow.run.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study_name = outcome.summary.get("study_name")
    storage = open_storage(None, outcome.run_dir)
    names = [study_name] if study_name else [s.study_name for s in optuna.get_all_study_summaries(storage)]
    study = optuna.load_study(study_name=names[0], storage=storage)
    return sorted(study.trials[trial].intermediate_values)


def exit_codes(outcome: Outcome, trial: int, ranks: int) -> list[int | None]:
    """Each rank's program's exit code as its log says: -N where a signal N killed it, None where the
    log says nothing of its end (its supervisor never saw it end)."""
    codes: list[int | None] = []
    for r in range(ranks):
        ends = re.findall(r"the program (?:exited with code (-?\d+)|killed by (SIG\w+|signal \d+))",
                          outcome.log(trial, r))
        if not ends:
            codes.append(None)
            continue
        code, sig = ends[-1]
        if code:
            codes.append(int(code))
        else:
            name = sig.removeprefix("signal ")
            codes.append(-(int(name) if name.isdigit() else int(getattr(signal, name, 0))))
    return codes
