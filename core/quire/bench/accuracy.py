"""``quire bench accuracy``: how far one configuration's next-token distributions are
from a reference's, on a fixed text (llama.cpp's ``llama-perplexity --kl-divergence``).

The text (``data/accuracy_text.txt`` unless another is given) is tokenized once with the
model's tokenizer, and that one sequence of ids goes through each configuration as a
single request: a prompt of the whole text, asking for prompt logprobs, so the engine
computes the logits of every position through its real path (the platform's kernels,
the configuration's weights and KV dtype; a text longer than the step's token budget is
prefilled in chunks, each reading the pages the earlier ones wrote). The engine core
hands every chunk of full-vocabulary prompt logits to
:attr:`~quire.engine.core.EngineCore.prompt_logits_observer` before taking its top-k;
nothing else in the engine changes.

Per position ``i`` (predicting token ``i+1``) the figures are those of llama.cpp:

- ``KL(ref || test) = sum_v p_ref(v) * (log p_ref(v) - log p_test(v))``, summed in
  float64 from each side's float32 ``log_softmax`` of its float32 logits; mean (with its
  standard error), max, 99.9th/99th percentile (linear interpolation), median, min
  (rounding may make a tiny negative value, as in llama.cpp);
- top-1 agreement: the share of positions where both argmaxes are the same token
  ("Same top p");
- the perplexity of each, ``exp(mean NLL)`` of the text's next tokens, and the change
  in the probability of the text's token (mean and RMS of ``p_test - p_ref``, "Δp").

Memory: the reference's log-probs are written, float32, to a file in a temporary
directory (``positions x vocab x 4`` bytes: 400 MB for 2,000 tokens of a 49k vocabulary)
and read back a block at a time; only one chunk of logits per engine is in memory, and
only one engine is alive at a time.

The llama.cpp peer (when installed, ``quire bench install-peer llamacpp``) runs the same
GGUF file on the same token ids (``llamacpp_worker.py``'s ``logits`` action) and its
logits are scored against the same float32 reference.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: The text shipped with the tool: Chapter I of Lewis Carroll's *Alice's Adventures in
#: Wonderland* (1865, public domain; see data/README.md), about 2,000 tokens.
DEFAULT_TEXT = Path(__file__).parent / "data" / "accuracy_text.txt"
#: What the reference changes in the tested options by default (only the fields this
#: build's EngineConfig has).
REFERENCE_DEFAULTS: dict[str, Any] = {"dtype": "float32", "quantization": "none",
                                      "quantization_config": None, "kv_cache_dtype": "auto"}
#: The step's token budget (``max_num_batched_tokens``) when the options give none: a
#: text of 2,000 tokens is prefilled in four chunks (the later ones read KV pages), and a
#: chunk's logits stay near 100 MB for a 49k vocabulary.
DEFAULT_CHUNK_TOKENS = 512
#: Rows turned into log-probs at a time (bounds the float64 temporaries).
_BLOCK_ROWS = 128

Sink = Callable[[int, torch.Tensor], None]


# -- text ----------------------------------------------------------------------------------
def load_text(path: str | Path | None = None) -> str:
    """The text of ``path`` (the shipped text when None).

    :raises ValueError: the file is missing, unreadable, not UTF-8, or empty.
    """
    path = Path(path) if path is not None else DEFAULT_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def text_token_ids(tokenizer: Any, text: str, max_tokens: int | None = None,
                   max_model_len: int | None = None) -> list[int]:
    """``text`` as the model's token ids (special tokens as the tokenizer adds them),
    cut to ``max_tokens`` and to ``max_model_len - 1`` (the request's one sampled token).

    :raises ValueError: fewer than 2 tokens (nothing to predict).
    """
    ids = list(tokenizer.encode(text))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if max_model_len is not None:
        ids = ids[:max_model_len - 1]
    if len(ids) < 2:
        raise ValueError(f"the text is {len(ids)} token(s); at least 2 are needed (one "
                         "position predicting the next)")
    return ids


# -- options -------------------------------------------------------------------------------
def engine_fields() -> set[str]:
    from quire.config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def reference_options(test_options: Mapping[str, Any],
                      overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The reference's options: the tested ones, with :data:`REFERENCE_DEFAULTS` (those
    this build knows), then ``overrides``."""
    known = engine_fields()
    defaults = {k: v for k, v in REFERENCE_DEFAULTS.items() if k in known}
    return {**test_options, **defaults, **(overrides or {})}


def _run_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the chunk size settled and no second replica (the core must
    run in this process to hand its logits over)."""
    out = dict(options)
    if out.get("max_num_batched_tokens") is None:
        out["max_num_batched_tokens"] = DEFAULT_CHUNK_TOKENS
    if int(out.get("data_parallel_size") or 1) != 1:
        raise ValueError("data_parallel_size: the accuracy run needs one replica (its "
                         "engine core in this process)")
    return out


# -- statistics ----------------------------------------------------------------------------
def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the vocabulary (where the logits are), on the CPU: the
    reference's are stored as computed, so identical logits give a KL of exactly 0."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1).cpu()


def kl_divergence(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """Per row, ``KL(ref || test)`` of two ``[rows, vocab]`` log-prob tensors (float64).
    A token the reference gives no probability adds nothing."""
    ref = ref_logprobs.to(torch.float64)
    test = test_logprobs.to(torch.float64)
    p = ref.exp()
    terms = torch.where(p > 0, p * (ref - test), torch.zeros((), dtype=torch.float64))
    return terms.sum(dim=-1)


@dataclass
class _Scores:
    """One configuration's per-position figures, filled as chunks arrive."""

    n: int
    nll: np.ndarray = field(init=False)
    top1: np.ndarray = field(init=False)
    kl: np.ndarray = field(init=False)
    filled: int = 0

    def __post_init__(self) -> None:
        self.nll = np.full(self.n, np.nan)
        self.top1 = np.full(self.n, -1, dtype=np.int64)
        self.kl = np.full(self.n, np.nan)

    def add(self, first: int, lp: torch.Tensor, targets: torch.Tensor,
            kl: torch.Tensor | None = None) -> None:
        k = lp.shape[0]
        self.nll[first:first + k] = (-lp.gather(1, targets[:, None])[:, 0]).numpy()
        self.top1[first:first + k] = lp.argmax(dim=-1).numpy()
        if kl is not None:
            self.kl[first:first + k] = kl.numpy()
        self.filled = max(self.filled, first + k)


class _ReferenceStore:
    """The reference's float32 log-probs, one row per position, in a file."""

    def __init__(self, directory: str, n: int, vocab: int) -> None:
        self.path = Path(directory) / "reference.f32"
        self.rows = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float32,
                                              shape=(n, vocab))
        self.vocab = vocab

    def write(self, first: int, lp: torch.Tensor) -> None:
        self.rows[first:first + lp.shape[0]] = lp.to(torch.float32).numpy()

    def read(self, first: int, k: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.rows[first:first + k]))

    def close(self) -> None:
        del self.rows


def _score_blocks(first: int, logits: torch.Tensor, targets: torch.Tensor,
                  scores: _Scores, store: _ReferenceStore, reference: bool) -> None:
    """Score ``logits`` (rows for positions ``first..``) a block of rows at a time."""
    for start in range(0, logits.shape[0], _BLOCK_ROWS):
        block = logits[start:start + _BLOCK_ROWS]
        pos = first + start
        lp = log_probs(block)
        tgt = targets[pos:pos + lp.shape[0]]
        if reference:
            store.write(pos, lp)
            scores.add(pos, lp, tgt)
        else:
            if lp.shape[1] != store.vocab:
                raise RuntimeError(f"the tested logits have {lp.shape[1]} entries, the "
                                   f"reference's {store.vocab}: not the same vocabulary")
            scores.add(pos, lp, tgt, kl_divergence(store.read(pos, lp.shape[0]), lp))


@dataclass(frozen=True)
class AccuracyResult:
    """The figures of one tested configuration against the reference."""

    #: What ran: ``{"model", "options", "description"}`` for each.
    test: dict[str, Any]
    reference: dict[str, Any]
    #: Tokens of the text run; positions scored (``num_tokens - 1``).
    num_tokens: int
    num_positions: int
    kl_mean: float
    kl_mean_stderr: float
    kl_max: float
    kl_p999: float
    kl_p99: float
    kl_median: float
    kl_min: float
    #: Share of positions (0..1) where both argmaxes are the same token.
    top1_agreement: float
    top1_agreement_stderr: float
    ppl_test: float
    ppl_ref: float
    #: Mean of ``ln(PPL(test) / PPL(ref))``'s per-token terms.
    ln_ppl_ratio: float
    #: Mean and RMS of ``p_test - p_ref`` of the text's next token (0..1).
    delta_p_mean: float
    delta_p_rms: float
    #: Per position, for tests and plots (not in :meth:`figures`).
    kl_per_position: tuple[float, ...] = ()

    def figures(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("test", "reference", "kl_per_position")}


def summarize(ref: _Scores, test: _Scores, test_info: dict[str, Any],
              ref_info: dict[str, Any]) -> AccuracyResult:
    """Figures of ``test`` against ``ref`` (both complete)."""
    n = ref.n
    kl = torch.from_numpy(test.kl)
    agree = float(np.mean(ref.top1 == test.top1))
    p_ref, p_test = np.exp(-ref.nll), np.exp(-test.nll)
    dp = p_test - p_ref
    q = torch.quantile(kl, torch.tensor([0.999, 0.99, 0.5], dtype=torch.float64)).tolist()
    return AccuracyResult(
        test=test_info, reference=ref_info, num_tokens=n + 1, num_positions=n,
        kl_mean=float(kl.mean()),
        kl_mean_stderr=float(kl.std() / math.sqrt(n)) if n > 1 else float("nan"),
        kl_max=float(kl.max()), kl_p999=q[0], kl_p99=q[1], kl_median=q[2],
        kl_min=float(kl.min()),
        top1_agreement=agree, top1_agreement_stderr=math.sqrt(agree * (1 - agree) / n),
        ppl_test=float(np.exp(np.mean(test.nll))), ppl_ref=float(np.exp(np.mean(ref.nll))),
        ln_ppl_ratio=float(np.mean(test.nll - ref.nll)),
        delta_p_mean=float(np.mean(dp)), delta_p_rms=float(np.sqrt(np.mean(dp * dp))),
        kl_per_position=tuple(test.kl.tolist()))


# -- running Quire -------------------------------------------------------------------------
def run_prompt_logits(model: str, options: Mapping[str, Any], token_ids: list[int],
                      sink: Sink, registry: Any = None) -> dict[str, Any]:
    """Run ``token_ids`` once through an engine of ``options`` and hand ``sink`` the
    float32 logits of every position ``0 .. len-2`` exactly once, in order, as
    ``sink(first_position, logits[k, vocab])``. The engine is shut down after.

    :returns: ``{"model", "options", "description"}`` of what ran.
    :raises ValueError: bad options, or a text the engine refuses.
    """
    from quire.bench.quire_engine import describe
    from quire.config import EngineConfig
    from quire.engine import LLMEngine
    from quire.plugins.registry import PlatformRegistry
    from quire.sampling_params import SamplingParams

    run = _run_options(options)
    config = EngineConfig.from_kwargs(model, **run)
    gc.collect()
    engine = LLMEngine(config, registry or PlatformRegistry())
    try:
        expected = len(token_ids) - 1
        done = 0

        def observe(_request_id: str, first: int, logits: torch.Tensor) -> None:
            nonlocal done
            if first + logits.shape[0] <= done:
                return  # a recompute after preemption: seen
            if first > done:
                raise RuntimeError(f"prompt logits from position {first} arrived before "
                                   f"those from {done}")
            rows = logits[done - first:]
            sink(done, rows.float())
            done += rows.shape[0]

        engine.core.prompt_logits_observer = observe
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=0)
        engine.add_request(list(token_ids), params)
        while engine.has_unfinished_requests():
            engine.step(final_only=True)
        if done != expected:
            raise RuntimeError(f"the engine gave logits for {done} of {expected} positions")
        info = {"model": model, "options": plain(dict(options)),
                "run_options": plain(run), "description": describe(engine),
                "dtype": str(engine.config.dtype).removeprefix("torch."),
                "quantization": _settled_quantization(config, engine),
                "kv_cache_dtype": getattr(config, "kv_cache_dtype", None),
                "platform": engine.info.platform_name}
    finally:
        engine.shutdown()
        del engine
        gc.collect()
    return info


def _settled_quantization(config: Any, engine: Any) -> str | None:
    """The method the workers settled for this checkpoint and platform (as each worker
    settles it), or the one asked for when this build settles none."""
    from quire.executor.worker import resolve_config

    try:
        settled = getattr(resolve_config(config, engine.core.platform), "quantization", None)
    except (ValueError, RuntimeError, AttributeError):
        settled = None
    method = getattr(settled, "method", None)
    return method if method is not None else getattr(config, "quantization", None)


def plain(options: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None), dict, list))
                else str(v)) for k, v in options.items()}


@dataclass
class Comparison:
    """A reference run, kept (its log-probs in a temporary file) so that several tested
    configurations or a peer can be scored against it. Use as a context manager."""

    model: str
    token_ids: list[int]
    ref_options: dict[str, Any]
    registry: Any = None
    ref_info: dict[str, Any] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _store: _ReferenceStore | None = None
    _ref: _Scores | None = None

    def __enter__(self) -> "Comparison":
        n = len(self.token_ids) - 1
        targets = torch.tensor(self.token_ids[1:], dtype=torch.int64)
        self._tmp = tempfile.TemporaryDirectory(prefix="quire-accuracy-")
        self._ref = _Scores(n)

        def sink(first: int, logits: torch.Tensor) -> None:
            if self._store is None:
                self._store = _ReferenceStore(self._tmp.name, n, logits.shape[1])
            _score_blocks(first, logits, targets, self._ref, self._store, reference=True)

        try:
            self.ref_info = run_prompt_logits(self.model, self.ref_options,
                                              self.token_ids, sink, self.registry)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _scorer(self) -> tuple[_Scores, Sink]:
        assert self._store is not None and self._ref is not None, "use inside `with`"
        test = _Scores(self._ref.n)
        targets = torch.tensor(self.token_ids[1:], dtype=torch.int64)
        store = self._store

        def sink(first: int, logits: torch.Tensor) -> None:
            _score_blocks(first, logits, targets, test, store, reference=False)

        return test, sink

    def score(self, test_options: Mapping[str, Any]) -> AccuracyResult:
        """Run ``test_options`` and score it against the reference."""
        test, sink = self._scorer()
        info = run_prompt_logits(self.model, test_options, self.token_ids, sink,
                                 self.registry)
        return summarize(self._ref, test, info, self.ref_info)

    def score_logits_file(self, path: str | Path, info: dict[str, Any]) -> AccuracyResult:
        """Score raw float32 logits ``[positions, vocab]`` in ``path`` (a peer's)."""
        test, sink = self._scorer()
        n = self._ref.n
        raw = np.memmap(path, dtype="<f4", mode="r")
        if raw.size % n:
            raise RuntimeError(f"{path} holds {raw.size} floats, not {n} rows")
        rows = raw.reshape(n, raw.size // n)
        for first in range(0, n, _BLOCK_ROWS):
            sink(first, torch.from_numpy(np.array(rows[first:first + _BLOCK_ROWS])))
        del rows, raw
        return summarize(self._ref, test, info, self.ref_info)


def compare(model: str, test_options: Mapping[str, Any] | None = None,
            ref_options: Mapping[str, Any] | None = None, text: str | None = None, *,
            max_tokens: int | None = None, registry: Any = None) -> AccuracyResult:
    """``test_options`` (engine options, as ``LLM(model, **options)`` takes them) against
    a reference on ``text`` (the shipped text when None).

    The reference is ``test_options`` with :data:`REFERENCE_DEFAULTS` (float32, no
    quantization, the default KV dtype), then ``ref_options`` on top. For tests of
    other features, e.g.::

        r = compare(path, {"device": "cpu", "dtype": "bfloat16"}, max_tokens=256)
        assert r.top1_agreement >= 0.99 and r.kl_mean <= 1e-3

    :raises ValueError: bad options or text.
    """
    from quire.config import EngineConfig
    from quire.model_store import model_path_of
    from quire.tokenizer import load_tokenizer

    test_options = dict(test_options or {})
    ref = reference_options(test_options, ref_options)
    config = EngineConfig.from_kwargs(model, **_run_options(test_options))
    EngineConfig.from_kwargs(model, **_run_options(ref))  # checked before anything runs
    tokenizer = load_tokenizer(config.tokenizer or model_path_of(config))
    ids = text_token_ids(tokenizer, text if text is not None else load_text(), max_tokens,
                         context_of(config))
    with Comparison(model, ids, ref, registry) as comparison:
        return comparison.score(test_options)


def context_of(config: Any) -> int | None:
    """The context the engine will have (``max_model_len`` or the model's)."""
    if config.max_model_len:
        return int(config.max_model_len)
    from quire.executor.worker import model_max_len
    from quire.model_store import model_path_of
    from quire.models.loader import load_model_config
    from quire.models.pooling import context_length

    path = model_path_of(config)
    return context_length(path, model_max_len(load_model_config(path)))


# -- the llama.cpp peer --------------------------------------------------------------------
def llamacpp_logits(gguf: str, token_ids: list[int], out_path: str, *, kv_type: str = "f16",
                    timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``token_ids`` through llama.cpp on ``gguf``; its float32 logits of positions
    ``0 .. len-2`` go to ``out_path``. :raises PeerError: not installed, or it failed."""
    from quire.bench.peers.runner import run_worker
    from quire.bench.peers.spec import PEERS

    job = {"action": "logits", "model": gguf, "token_ids": list(token_ids),
           "output": out_path, "options": {"kv_type": kv_type,
                                           "n_batch": DEFAULT_CHUNK_TOKENS}}
    return run_worker(PEERS["llamacpp"], job, timeout_s)


def score_llamacpp(comparison: Comparison, gguf: str, *, kv_type: str = "f16",
                   timeout_s: float | None = None) -> AccuracyResult:
    """llama.cpp's execution of ``gguf`` against the comparison's reference.

    :raises PeerError: as :func:`llamacpp_logits`; RuntimeError: a vocabulary mismatch.
    """
    assert comparison._tmp is not None, "use inside `with`"
    out = str(Path(comparison._tmp.name) / "llamacpp.f32")
    result = llamacpp_logits(gguf, comparison.token_ids, out, kv_type=kv_type,
                             timeout_s=timeout_s)
    info = {"model": gguf, "options": {"kv_type": kv_type,
                                       "n_batch": DEFAULT_CHUNK_TOKENS},
            "description": result.get("engine", "llama.cpp")}
    try:
        return comparison.score_logits_file(out, info)
    finally:
        Path(out).unlink(missing_ok=True)


# -- report --------------------------------------------------------------------------------
#: (key, label, how shown) of the table's rows.
TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("kl_mean", "mean KL(ref || test)", "kl"),
    ("kl_mean_stderr", "  its standard error", "kl"),
    ("kl_max", "max KL", "kl"),
    ("kl_p999", "99.9% KL", "kl"),
    ("kl_p99", "99% KL", "kl"),
    ("kl_median", "median KL", "kl"),
    ("top1_agreement", "top-1 agreement", "pct"),
    ("ppl_test", "perplexity (tested)", "num"),
    ("ppl_ref", "perplexity (reference)", "num"),
    ("ln_ppl_ratio", "ln(PPL test / PPL ref)", "kl"),
    ("delta_p_mean", "mean Δp (text's token)", "pct"),
    ("delta_p_rms", "RMS Δp", "pct"),
)


def _shown(value: float, how: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if how == "pct":
        return f"{100 * value:.3f}%"
    if how == "kl":
        return f"{value:.6f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    return f"{value:.4f}"


def table(columns: Mapping[str, AccuracyResult]) -> str:
    """Figures down, one column per tested engine."""
    from quire.bench.report import grid

    rows = [[label, *(_shown(getattr(r, key), how) for r in columns.values())]
            for key, label, how in TABLE_ROWS]
    return grid(["figure", *columns], rows)
