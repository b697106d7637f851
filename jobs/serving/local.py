"""A model in this Python process: what ``ctx serve``'s routes answer, without a server or Ray.

    from jobs.serving.local import LocalModel

    model = LocalModel("runs/minilm-lexname")   # checkpoint, run or HF folder; s3://; pkg:; models:/NAME@ALIAS
    vectors = model.encode(["the river bank", "the bank raised rates"], normalize=True)  # (2, 384) float32
    model.classify("a small dog")                 # [{"index": 0, "label": ..., "score": ..., "scores": {...}}]

It runs ``jobs.serving.replica.EmbeddingReplica``, the class behind every served replica and ``ctx
embed``'s actors: the same loading (a run folder's best or newest checkpoint), tokenizer, length-sorted
passes of at most ``max_batch_size`` rows and ``max_batch_tokens`` padded tokens, pooling and task heads.
So ``encode`` gives the vectors /v1/embeddings gives, and each task method the ``data`` of its route
(``token_embeddings`` the ``data`` of /v1/token-embeddings with arrays for vectors; ``rerank`` TEI's
list). Inputs are checked by the routes' own request models, so a bad one raises ``ValueError`` with the
message a client would read in its 4xx, and a model asked for a route it does not serve says which it
serves. Requests have no size limits here: the caller owns the memory.

Unlike the server, ``truncate`` defaults to True, as sentence-transformers' ``encode`` cuts a text to
the model's length: a script embedding a corpus should not stop at its first long text.

Thread-safe: calls from several threads share the replica's forward passes (task rows are batched
across them, as the server batches requests)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

from jobs.runs import model_checkpoint
from jobs.serving.precision import PRECISIONS, quantize
from jobs.serving.replica import EmbeddingReplica
from jobs.serving.serve_config import Limits, ModelConfig
from jobs.serving.serve_tasks import REQUESTS, check_texts

UNBOUNDED = 2**62  # no request limits in-process


class LocalModel:
    """One model loaded in this process (see the module's docstring). ``model``: what ``ctx serve``'s
    ``uri`` takes. ``dtype``, ``language``, ``max_batch_size``, ``max_batch_tokens``, ``cuda_graphs``,
    ``pooling`` and ``normalize`` are the serve config's model settings, with its defaults ("auto" is
    float16 on a GPU, float32 on the CPU; pooling and normalize None: the model's own)."""

    def __init__(self, model: str, *, dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto",
                 language: int | str | None = None, max_batch_size: int = 32, max_batch_tokens: int = 16384,
                 cuda_graphs: bool = True, pooling: Literal["mean", "cls", "last"] | None = None,
                 normalize: bool | None = None, name: str = "local"):
        checkpoint, registered = model_checkpoint(model)  # models:/NAME@ALIAS through the registry, once
        try:
            settings = ModelConfig(uri=checkpoint, dtype=dtype, language=language, max_batch_size=max_batch_size,
                                   max_batch_tokens=max_batch_tokens, cuda_graphs=cuda_graphs, pooling=pooling,
                                   normalize=normalize,
                                   batch_wait_timeout_s=0.0)  # a caller alone never waits for company
        except ValidationError as e:
            raise ValueError(_message(e)) from None
        limits = Limits(max_inputs=UNBOUNDED, max_chars_per_text=UNBOUNDED, max_chars_per_request=UNBOUNDED,
                        max_tokens_per_request=UNBOUNDED, max_token_embedding_values=UNBOUNDED, max_new_tokens=UNBOUNDED)
        # The task routes batch through asyncio (jobs.serving.batching.Batcher): one loop of this object's
        # own, on a thread, serves every caller.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ctx-local-model", daemon=True)
        self._thread.start()
        self.name = name
        self._closed = weakref.finalize(self, _stop, self._loop, self._thread)  # at close, collection or exit
        self._replica = self._run(self._load(name, checkpoint, settings, limits, registered.ref if registered else None))

    async def _load(self, name: str, checkpoint: str, settings: ModelConfig, limits: Limits, registry_version: str | None):
        return EmbeddingReplica(name, checkpoint, None, settings, limits, registry_version)

    def _run(self, coro):
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError(f"model {self.name!r} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- what the model is ---

    @property
    def info(self) -> dict[str, Any]:
        """What /v1/models says of it: family, dim, max_len, dtype, version, tokenizer_hash, task, labels, routes..."""
        return self._replica.info()

    @property
    def dim(self) -> int:
        return self._replica.dim

    # --- embeddings ---

    def encode(self, texts: str | list[str], *, pooling: Literal["mean", "cls", "last"] | None = None,
               normalize: bool | None = None, dimensions: int | None = None, truncate: bool = True, features: str = "last",
               language: int | str | None = None, prompt: str | None = None, prompt_name: str | None = None,
               batch_size: int | None = None,
               show_progress_bar: bool = False,
               output_value: Literal["sentence_embedding", "token_embeddings"] = "sentence_embedding",
               convert_to_numpy: bool = True, convert_to_tensor: bool = False,
               normalize_embeddings: bool | None = None, truncate_dim: int | None = None,
               precision: Literal["float32", "int8", "uint8", "binary", "ubinary"] = "float32") -> Any:
        """Sentence vectors: float32 (N, dim), or (dim,) for one string, as /v1/embeddings gives them.
        ``dimensions`` keeps the first ones (Matryoshka), re-normalised when ``normalize``; ``features``
        combines layers as ELMo's and BERT's papers did (``ctxmodels.features``). ``pooling`` and
        ``normalize`` left None are the model's: a sentence-transformers folder's pooling and Normalize
        module (``info["sentence_transformers"]``), else mean pooling, not normalised.

        sentence-transformers' ``encode`` keywords mean what they mean there, so its callers' code runs:
        ``prompt`` is put before every text, ``prompt_name`` names one of the folder's prompts (without
        either, its default prompt, if it names one, is used); ``batch_size`` is the rows of a forward
        pass (default: the model's ``max_batch_size``), passes still cut at ``max_batch_tokens``;
        ``show_progress_bar`` counts texts as they are done; ``normalize_embeddings`` is ``normalize``;
        ``truncate_dim`` cuts the finished vectors (normalised again only with ``normalize_embeddings``,
        as there; ``dimensions`` always re-normalises a normalised vector); ``convert_to_tensor`` gives
        one torch tensor, ``convert_to_numpy=False`` a list of them; ``output_value="token_embeddings"`` gives a
        list of torch tensors, each text's (tokens, width) vectors of the last layer, special tokens
        included (as there, whatever the convert_to_* keywords say); ``precision`` quantizes the
        finished vectors as its ``quantize_embeddings`` does (``quantize``)."""
        if normalize_embeddings:  # False leaves a model with a Normalize module normalising, as there
            normalize = True
        if dimensions is not None and truncate_dim is not None:
            raise ValueError("dimensions and truncate_dim: give one of them (truncate_dim cuts the finished vectors, "
                             "as sentence-transformers does; dimensions cuts, then normalises, as /v1/embeddings)")
        if truncate_dim is not None and not 1 <= truncate_dim <= self.dim:
            raise ValueError(f"truncate_dim {truncate_dim}: the model gives {self.dim}-dimensional vectors; ask for 1..{self.dim}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size {batch_size}: give at least 1 row a forward pass")
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: give one of {', '.join(PRECISIONS)}")
        if output_value not in ("sentence_embedding", "token_embeddings"):
            raise ValueError(f"output_value {output_value!r}: give 'sentence_embedding' or 'token_embeddings'")
        batch = _texts(texts)
        if output_value == "token_embeddings":
            batch = self._replica._sentence_defaults(batch, pooling, normalize, prompt_name, prompt)[0]
            rows = self.token_embeddings(batch, truncate=truncate, language=language)
            convert_to_numpy, convert_to_tensor = False, False
            vectors = [row["embeddings"] for row in rows]
        else:
            vectors = np.empty((len(batch), dimensions or self._replica._strategy(features)), np.float32)
            for part in _parts(batch, show_progress_bar, f"encoding with {self.name}"):
                out = self._replica.embed_now([batch[i] for i in part], pooling=pooling, normalize=normalize,
                                              dimensions=dimensions, truncate=truncate, features=features,
                                              language=language, max_rows=batch_size, prompt_name=prompt_name,
                                              prompt=prompt)
                vectors[part] = np.stack(out["embeddings"])
            if truncate_dim is not None:  # the finished vectors cut, normalised again only if asked, as there
                vectors = vectors[:, :truncate_dim]
                if normalize_embeddings:
                    vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            vectors = quantize(vectors, precision)
        if convert_to_tensor or not convert_to_numpy:
            import torch

            if convert_to_tensor:
                vectors = torch.from_numpy(vectors)
            else:
                vectors = [torch.from_numpy(np.asarray(v)) for v in vectors]
        return vectors[0] if isinstance(texts, str) else vectors

    def encode_query(self, texts: str | list[str], **keywords: Any) -> Any:
        """``encode`` with the folder's "query" prompt unless a prompt is given, as sentence-transformers'."""
        return self.encode(texts, **self._prompt_for(keywords, ("query",)))

    def encode_document(self, texts: str | list[str], **keywords: Any) -> Any:
        """``encode`` with the folder's "document", "passage" or "corpus" prompt (the first it has)
        unless a prompt is given, as sentence-transformers'; like there, a folder with a "query" prompt
        and no "document" one gives documents no prompt."""
        return self.encode(texts, **self._prompt_for(keywords, ("document", "passage", "corpus")))

    def _prompt_for(self, keywords: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
        prompts = dict(self._replica.sentence.prompts) if self._replica.sentence is not None else {}
        if "query" in prompts:
            prompts.setdefault("document", "")  # sentence-transformers adds it when it loads such a folder
        if keywords.get("prompt") is None and keywords.get("prompt_name") is None:
            name = next((name for name in names if name in prompts), None)
            if name is not None:
                keywords["prompt"] = prompts[name]
        return keywords

    def similarity(self, a: Any, b: Any) -> Any:
        """The model's similarity of every vector of ``a`` with every vector of ``b``: a float32 torch
        tensor (len(a), len(b)), as sentence-transformers' ``similarity`` gives it. Cosine, unless the
        model's sentence-transformers folder names another (dot; euclidean and manhattan as negative
        distances, as there). ``a``, ``b``: what ``encode`` gives (arrays or tensors, one vector or many)."""
        import torch

        x, y = (torch.as_tensor(np.asarray(v, dtype=np.float32) if not isinstance(v, torch.Tensor) else v).float()
                for v in (a, b))
        x, y = (v.unsqueeze(0) if v.dim() == 1 else v for v in (x, y))
        name = self._replica.sentence.similarity if self._replica.sentence is not None else "cosine"
        if name == "dot":
            return x @ y.T
        if name in ("euclidean", "manhattan"):
            return -torch.cdist(x, y, p=2.0 if name == "euclidean" else 1.0)
        return torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(y, dim=-1).T

    def get_embedding_dimension(self) -> int:
        """sentence-transformers' name for ``dim`` (``get_sentence_embedding_dimension`` is its older one)."""
        return self.dim

    get_sentence_embedding_dimension = get_embedding_dimension

    @property
    def max_seq_length(self) -> int:
        """The tokens a text keeps (special tokens included) before ``truncate`` cuts it."""
        return int(self._replica.max_len)

    def token_embeddings(self, texts: str | list[str], *, layers: str | list[int] = "last", features: str | None = None,
                         granularity: Literal["token", "word"] = "token", truncate: bool = True,
                         language: int | str | None = None) -> list[dict[str, Any]]:
        """Per text a dict of its ``tokens`` (or ``words``), character ``offsets``, ``n_tokens`` and
        ``embeddings``, float32 (tokens or words, width): the layers asked, concatenated, or ``features``
        combined, as /v1/token-embeddings gives them."""
        coro = self._replica._token_embeddings(_texts(texts), layers=layers, truncate=truncate, features=features,
                                               granularity=granularity, language=language)
        return self._run(coro)["rows"]

    def encode_sparse(self, texts: str | list[str], *, truncate: bool = True, prompt_name: str | None = None,
                      convert_to_sparse_tensor: bool = True) -> Any:
        """A SPLADE model's vector of each text over its vocabulary, as sentence-transformers'
        ``SparseEncoder.encode`` gives it: a (texts, V) torch sparse COO tensor of float32 weights (dense with
        ``convert_to_sparse_tensor=False``), the weights /embed_sparse answers. ``prompt_name``: one of the
        folder's prompts, put before each text (None: its default prompt)."""
        import torch

        vectors, _ = self._run(self._replica.sparse_vectors(_texts(texts), truncate, prompt_name))
        vocab = self._replica.tokenizer.vocab_size
        rows = np.concatenate([np.full(len(v["indices"]), i) for i, v in enumerate(vectors)] or [np.zeros(0)]).astype(np.int64)
        cols = np.concatenate([v["indices"] for v in vectors] or [np.zeros(0, np.int64)]).astype(np.int64)
        values = np.concatenate([v["values"] for v in vectors] or [np.zeros(0, np.float32)]).astype(np.float32)
        out = torch.sparse_coo_tensor(torch.from_numpy(np.stack([rows, cols])), torch.from_numpy(values), (len(vectors), vocab),
                                      is_coalesced=True, check_invariants=False)  # built sorted and unique: nothing to check
        return out if convert_to_sparse_tensor else out.to_dense()

    # --- the task routes: each gives its route's answer ---

    def _task(self, route: str, **fields: Any) -> Any:
        try:
            request = REQUESTS[route].model_validate({"model": self.name, **fields})
        except ValidationError as e:
            raise ValueError(_message(e)) from None
        problem = request.limit_problem(self._replica.limits)
        if problem is not None:
            raise ValueError(problem)
        body = self._run(self._replica._task(route, request.payload()))["body"]
        return request.answer(body) if route == "/v1/rerank" else body

    def classify(self, texts: str | list[str] | list[tuple[str, str]], *, truncate: bool = True,
                 language: int | str | None = None) -> list[dict[str, Any]]:
        """A classification or regression model's answer per input (texts, or (text, text_pair) pairs):
        /v1/classify's ``data``."""
        return self._task("/v1/classify", input=texts, truncate=truncate, language=language)["data"]

    def tag(self, texts: str | list[str] | None = None, *, words: list[list[str]] | None = None, scheme: str | None = None,
            truncate: bool = True, language: int | str | None = None) -> list[dict[str, Any]]:
        """A token-classification model's tags per text (``texts``, split at whitespace) or per
        pre-split text (``words``): /v1/tag's ``data``."""
        return self._task("/v1/tag", input=texts, words=words, scheme=scheme, truncate=truncate, language=language)["data"]

    def answer(self, questions: str | list[str], contexts: str | list[str], *, truncate: bool = True,
               language: int | str | None = None) -> list[dict[str, Any]]:
        """A question-answering model's answer (text, character span, score) per question, one context
        each: /v1/answer's ``data``."""
        return self._task("/v1/answer", question=questions, context=contexts, truncate=truncate, language=language)["data"]

    def rerank(self, query: str, texts: list[str], *, raw_scores: bool = False, return_text: bool = False,
               truncate: bool = True, language: int | str | None = None) -> list[dict[str, Any]]:
        """``texts`` ranked against ``query`` by a pair model, best first: [{"index", "score", "text"?}]
        (TEI's /rerank answer, which /v1/rerank gives)."""
        return self._task("/v1/rerank", query=query, texts=texts, raw_scores=raw_scores, return_text=return_text,
                          truncate=truncate, language=language)

    def fill_mask(self, texts: str | list[str], *, top_k: int = 5, truncate: bool = True,
                  language: int | str | None = None) -> list[dict[str, Any]]:
        """A masked-LM model's ``top_k`` tokens for each mask token of each text: /v1/fill-mask's ``data``."""
        return self._task("/v1/fill-mask", input=texts, top_k=top_k, truncate=truncate, language=language)["data"]

    def generate(self, prompt: str, *, max_tokens: int = 16, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, language: int | str | None = None) -> dict[str, Any]:
        """A causal model's continuation of ``prompt``: /v1/generate's answer ({"choices": [{"text",
        "token_ids", "tokens", "finish_reason"}], "seed", "usage"}); the same seed gives the same text."""
        return self._task("/v1/generate", prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed, language=language)

    def tokenize(self, texts: str | list[str], *, add_special_tokens: bool = True) -> list[dict[str, Any]]:
        """Per text its ids, tokens, offsets, n_tokens and whether it fits the model: /tokenize's ``data``."""
        return self._task("/tokenize", input=texts, add_special_tokens=add_special_tokens)["data"]

    # --- lifetime ---

    def close(self) -> None:
        """Stop this object's event loop; the weights (and the tokenizing threads) go with the object.
        Also done when it is garbage-collected, and at exit."""
        self._closed()

    def __enter__(self) -> LocalModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        info = self._replica.info()
        return f"LocalModel({info['checkpoint']!r}, family={info['family']!r}, dim={info['dim']}, task={info['task']!r})"


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """End a LocalModel's loop: its tasks (the batchers' workers, idle between calls) cancelled first,
    so none is left pending, then the loop and its thread."""
    if loop.is_closed():
        return
    asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _texts(texts: Any) -> list[str]:
    """A string or a list of strings (any other iterable of them is listed), checked as /v1/embeddings
    checks its input."""
    if not isinstance(texts, (str, list)) and hasattr(texts, "__iter__"):  # a tuple, a pandas Series, an array
        texts = [t.item() if isinstance(t, np.generic) else t for t in texts]
    try:
        check_texts(texts, allow_str=True)
    except ValueError as e:
        raise ValueError(f"texts {e}") from None
    return [texts] if isinstance(texts, str) else list(texts)


PROGRESS_CHUNK = 1024  # texts a step of encode's progress bar


def _parts(texts: list[str], progress: bool, what: str):
    """The indices of ``texts`` in calls to make: all at once, or with a progress bar, the longest
    texts first (as sentence-transformers orders them) in chunks of PROGRESS_CHUNK, each chunk counted
    when done. A pass is made of texts of about one length either way."""
    if not progress:
        yield list(range(len(texts)))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), transient=False) as bar:
        task = bar.add_task(what, total=len(texts))
        for at in range(0, len(order), PROGRESS_CHUNK):
            part = order[at:at + PROGRESS_CHUNK]
            yield part
            bar.advance(task, len(part))


def _message(e: ValidationError) -> str:
    """pydantic's errors in one line each: ``field: what was wrong``."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'input'}: {err['msg'].removeprefix('Value error, ')}"
                     for err in e.errors())
