"""Stand-in data for the corpus's programs, in the formats they read, made here so nothing is downloaded:
small, seeded (the same bytes every time) and learnable (the classes differ), so a trial learns
something in a second or two.

- ``names``: the PyTorch char-RNN tutorial's ``data/names/<Language>.txt`` (one name a line), which
  opacus's char-lstm-classification.py reads from ``--data-root``.
- ``imdb``: what ``datasets.load_dataset("imdb", cache_dir=D)`` finds in its cache when offline
  (``D/imdb/plain_text/0.0.0/<hash>/``: ``imdb-train.arrow``, ``imdb-test.arrow`` and
  ``dataset_info.json``, written by the ``json`` builder of ``datasets``); a Hugging Face hub cache
  (``hub/``, for ``HF_HUB_CACHE``) holding ``bert-base-cased``'s tokenizer files (a WordPiece vocabulary of
  the stand-in reviews' words), and ``tinybert/``: a randomly initialised 1-layer BERT for sequence
  classification (one logit) with that tokenizer, saved with ``save_pretrained``.
- ``sft``: ``model/``, a randomly initialised 1-layer Llama with a word-level tokenizer; ``data/``,
  ``train.jsonl`` and ``test.jsonl`` of ``{"text": ...}`` lines (what ``load_dataset(DIR)`` reads); ``prefs/``,
  the same of ``{"prompt", "chosen", "rejected"}`` preference pairs.
- ``mnist``: ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``, the idx files
  ``torchvision.datasets.MNIST(root)`` checks for before it would download.

``make(kind, pythonpath)`` returns the folder (made once, kept under the corpus cache); the HF stand-ins
are made in a subprocess with the runtime packages on ``PYTHONPATH``, so the test process never imports
them. ``python -m tests.corpus.standins KIND DEST`` makes one by hand.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from tests.corpus.sources import Unavailable, cache_root, filled

VERSION = 2  # of the generators: a change here makes new stand-ins
KINDS = ("names", "imdb", "sft", "mnist")
ROOT = Path(__file__).resolve().parents[2]

# An address nothing listens on: every HTTP(S) request a program makes through a proxy-aware client
# fails at once, so a stand-in that was not found shows as an error rather than a download.
DEAD_PROXY = "http://127.0.0.1:9"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "WANDB_MODE": "disabled",
               "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "http_proxy": DEAD_PROXY,
               "https_proxy": DEAD_PROXY, "NO_PROXY": "", "no_proxy": ""}

_POS = "good great fine superb lovely wonderful moving clever".split()
_NEG = "bad awful poor boring dull terrible clumsy weak".split()
_COMMON = "the film movie was plot actors a and story it this".split()


def make(kind: str, pythonpath: list[Path]) -> Path:
    """The stand-in ``kind`` (one of ``KINDS``), made once under the cache and reused."""
    if kind not in KINDS:
        raise ValueError(f"no stand-in {kind!r}; there are {KINDS}")
    dest = cache_root() / "standins" / f"{kind}-v{VERSION}"

    def generate(staging: Path) -> str:
        if kind in ("names", "mnist"):
            GENERATORS[kind](staging)
        else:
            env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(staging / ".hf-home"),
                   "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, pythonpath)])}
            r = subprocess.run([sys.executable, "-m", "tests.corpus.standins", kind, str(staging)], env=env,
                               capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
            if r.returncode != 0:
                raise Unavailable(f"the {kind} stand-in could not be made: {r.stderr.strip()[-1500:]}")
            shutil.rmtree(staging / ".hf-home", ignore_errors=True)
        for old in dest.parent.glob(f"{kind}-v*"):  # earlier generators' stand-ins
            if old != dest and not old.name.endswith(".partial"):
                shutil.rmtree(old, ignore_errors=True)
        return f"v{VERSION}"

    return filled(dest, f"standin-{kind}", generate)


def names(dest: Path) -> None:
    """Four 'languages' of 60 names each, drawn from different letters."""
    rng = random.Random(0)
    letters = {"English": "etaoinshrdl", "French": "eauilnrstoc", "German": "enrstiahdug", "Italian": "aeionlrtcs"}
    folder = dest / "names"
    folder.mkdir(parents=True)
    for lang, chars in letters.items():
        rows = ["".join(rng.choice(chars) for _ in range(rng.randint(3, 8))).capitalize() for _ in range(60)]
        (folder / f"{lang}.txt").write_text("\n".join(rows) + "\n")


def mnist(dest: Path) -> None:
    """MNIST's four idx files (uncompressed, as torchvision keeps them): 512 training and 128 test images
    of 28x28, digit d a bright bar at row 2 + 2d on faint noise."""
    rng = random.Random(0)
    raw = dest / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 512), ("t10k", 128)):
        labels = [i % 10 for i in range(n)]
        rng.shuffle(labels)
        pixels = bytearray()
        for d in labels:
            img = bytearray(rng.randrange(0, 40) for _ in range(28 * 28))
            for r in range(2 + 2 * d, 4 + 2 * d):
                for c in range(4, 24):
                    img[r * 28 + c] = 200 + rng.randrange(0, 56)
            pixels += img
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + bytes(pixels))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + bytes(labels))


def _reviews(rng: random.Random, n: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(n):
        label = i % 2
        words = [rng.choice(_COMMON + (_POS if label else _NEG)) for _ in range(rng.randint(6, 20))]
        out.append({"text": " ".join(words), "label": label})
    return out


def imdb(dest: Path) -> None:  # pragma: no cover - runs in a subprocess with datasets importable
    # imported by name: Any to the type checker (datasets is a runtime package of the corpus, not of hpoflow)
    datasets = importlib.import_module("datasets")
    Json = importlib.import_module("datasets.packaged_modules.json.json").Json
    tf = importlib.import_module("transformers")
    BertConfig, BertForSequenceClassification, BertTokenizerFast = (
        tf.BertConfig, tf.BertForSequenceClassification, tf.BertTokenizerFast)

    importlib.import_module("torch").manual_seed(0)  # the model's initial weights
    rng = random.Random(0)
    raw = dest / "raw"
    raw.mkdir()
    for split, n in (("train", 64), ("test", 32)):
        (raw / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _reviews(rng, n)))
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    builder = Json(cache_dir=str(dest / "build"), dataset_name="imdb", config_name="plain_text", features=features,
                   data_files={s: str(raw / f"{s}.jsonl") for s in ("train", "test")})
    builder.download_and_prepare()
    # where load_dataset("imdb", cache_dir=dest/"imdb") looks offline: imdb/<config>/<version>/<hash>/
    final = dest / "imdb" / "imdb" / "plain_text" / "0.0.0" / ("0" * 16)
    final.parent.mkdir(parents=True)
    shutil.move(builder.cache_dir, final)
    info = json.loads((final / "dataset_info.json").read_text())
    info["config_name"] = "plain_text"
    (final / "dataset_info.json").write_text(json.dumps(info))
    shutil.rmtree(dest / "build")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(_POS + _NEG + _COMMON))]
    commit = "0" * 40
    repo = dest / "hub" / "models--bert-base-cased"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snap / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (snap / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "model_max_length": 512,
                                                            "tokenizer_class": "BertTokenizer"}))
    tok = BertTokenizerFast(vocab_file=str(snap / "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(dest / "tinybert")
    config = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(dest / "tinybert")


def sft(dest: Path) -> None:  # pragma: no cover - runs in a subprocess
    tk = importlib.import_module("tokenizers")
    tf = importlib.import_module("transformers")
    Tokenizer, models, pre_tokenizers, trainers = tk.Tokenizer, tk.models, tk.pre_tokenizers, tk.trainers
    LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast = (
        tf.LlamaConfig, tf.LlamaForCausalLM, tf.PreTrainedTokenizerFast)

    importlib.import_module("torch").manual_seed(0)
    rng = random.Random(0)
    words = "the a cat dog sat ran on under mat log red blue big small quickly slowly".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))) for _ in range(96)]
    data = dest / "data"
    data.mkdir()
    for split, rows in (("train", lines[:80]), ("test", lines[80:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(dest / "model")
    # preference pairs for TRL's dpo.py: a fixed good completion against random words
    prefs = dest / "prefs"
    prefs.mkdir()
    for split, n in (("train", 64), ("test", 16)):
        pairs = [{"prompt": " ".join(rng.choice(words) for _ in range(4)), "chosen": " the cat sat on the mat",
                  "rejected": " " + " ".join(rng.choice(words) for _ in range(6))} for _ in range(n)]
        (prefs / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    config = LlamaConfig(vocab_size=len(fast), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=2,
                         eos_token_id=3, pad_token_id=1)
    LlamaForCausalLM(config).save_pretrained(dest / "model")


GENERATORS = {"names": names, "imdb": imdb, "sft": sft, "mnist": mnist}


if __name__ == "__main__":
    kind, target = sys.argv[1], Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    GENERATORS[kind](target)
