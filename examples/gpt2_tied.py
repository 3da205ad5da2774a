"""Partition a GPT-2 whose output head is tied to its token table, train it, and hand it back to stock code.

    python examples/gpt2_tied.py [--steps 20] [--shards 4] [--out DIR]

The token table (``transformer.wte.weight``, shared with ``lm_head.weight``) is split once into
``--shards`` mod shards: the lookup reads them and the head computes its logits shard by shard
(vocabulary-parallel). After training, the model is saved two ways and loaded into the stock,
unsharded GPT-2: with ``save_pretrained`` / ``from_pretrained``, and as a shardvar checkpoint
(logical variables, restorable into any layout). Both give the partitioned model's logits, and
the stock model's head is still tied to its table. Needs ``transformers`` (a tiny model is built
from a config: nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import shardvar
from shardvar import PartitionSpec, partition_model


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=512, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def train(model: GPT2LMHeadModel, steps: int) -> tuple[float, float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 512, (8, 17), generator=g)  # a fixed batch: the loss must go down
    losses = []
    for _ in range(steps):
        loss = model(text, labels=text).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def main() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages for large tensors, before the first one
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="where to save (default: a temporary directory)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_gpt2()
    part = partition_model(model, {"lm_head.weight": PartitionSpec(args.shards, "mod")})  # either tied name works
    table = shardvar.sharded_parameters(model)["transformer.wte.weight"]
    users = part.parameters["lm_head.weight"].users
    print(f"table {list(table.shape)} in {table.layout.num_shards} shards, shared by {users}")
    first, last = train(model.train(), args.steps)
    print(f"training loss {first:.3f} -> {last:.3f}")
    model.eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        logits = model(ids).logits
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        model.save_pretrained(out / "hf")  # stock keys: transformer.wte.weight, not shard names
        shardvar.save({"model": model}, out / "shardvar")
        for how in ("from_pretrained", "shardvar.load"):
            if how == "from_pretrained":
                stock = GPT2LMHeadModel.from_pretrained(out / "hf")
            else:
                stock = tiny_gpt2()
                shardvar.load({"model": stock}, out / "shardvar")
            with torch.no_grad():
                diff = (stock.eval()(ids).logits - logits).abs().max().item()
            tied = stock.lm_head.weight is stock.transformer.wte.weight
            print(f"stock GPT-2 via {how}: max |logits diff| = {diff:.2e}, lm_head tied to wte: {tied}")


if __name__ == "__main__":
    main()
