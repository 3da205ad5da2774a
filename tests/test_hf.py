"""HuggingFace GPT-2 and BERT (tiny, from configs) partitioned with their tied tables, against the stock models.

Logits, state_dict keys and order, save_pretrained -> stock from_pretrained (still tied), stock
checkpoint -> partitioned model, training, greedy generate and shardvar checkpoints into the
stock model. resize_token_embeddings and tie_weights refuse a partitioned model, changing nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shardvar
from shardvar import PartitionSpec, sharded_parameters
from shardvar.transform import partition_model

transformers = pytest.importorskip("transformers")

VOCAB = 50


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, pad_token_id=0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config).eval()


CASES = {
    "gpt2-mod": (gpt2, {"lm_head.weight": PartitionSpec(3, "mod"), "transformer.h.0.mlp.c_fc.weight": "1,2"}),
    "gpt2-div": (gpt2, {"transformer.wte.weight": 4, "lm_head.weight": 4, "transformer.wpe.weight": 2}),
    "bert-tied-bias": (bert, {"cls.predictions.decoder.weight": 3, "cls.predictions.bias": PartitionSpec(2, "mod")}),
    "bert-axis1": (bert, {"bert.embeddings.word_embeddings.weight": "1,2"}),
}
TIES = {gpt2: ("transformer.wte.weight", "lm_head.weight"),
        bert: ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")}  # fmt: skip
IDS = torch.tensor([[3, 17, 42, 8, 1, 29, 5], [11, 2, 47, 33, 30, 9, 14]])


def partitioned(case: str) -> tuple[torch.nn.Module, torch.nn.Module, tuple[str, str]]:
    build, strategy = CASES[case]
    model = build()
    reference = copy.deepcopy(model)
    partition_model(model, strategy)
    return model, reference, TIES[build]


def assert_same_logits(model, reference, atol=1e-6) -> None:
    torch.testing.assert_close(model(IDS).logits, reference(IDS).logits, atol=atol, rtol=0)


def assert_tied(model, names) -> None:
    a, b = (model.get_parameter(n) for n in names)
    assert a is b


@pytest.mark.parametrize("case", CASES)
def test_logits_and_state_dict_keys_are_the_stock_models(case) -> None:
    model, reference, ties = partitioned(case)
    assert_same_logits(model, reference)
    assert list(model.state_dict()) == list(reference.state_dict())
    found = sharded_parameters(model)
    assert found[ties[0]].variables == found[ties[1]].variables  # one set of shards
    model.load_state_dict(reference.state_dict())  # the stock state_dict loads as it is (strict)
    assert_same_logits(model, reference)
    if case == "bert-tied-bias":  # vocabulary-parallel head, its bias stored as shards on it, still tied
        assert isinstance(model.cls.predictions.decoder, shardvar.ShardedLinear)
        assert found["cls.predictions.bias"].variables == found["cls.predictions.decoder.bias"].variables


@pytest.mark.parametrize("case", CASES)
def test_save_pretrained_loads_into_the_stock_model_still_tied(case, tmp_path) -> None:
    model, reference, ties = partitioned(case)
    model.save_pretrained(tmp_path)
    stock = type(reference).from_pretrained(tmp_path).eval()
    assert_same_logits(stock, reference)
    assert_tied(stock, ties)


def test_a_stock_checkpoint_loads_and_is_then_partitioned(tmp_path) -> None:
    reference = gpt2()
    reference.save_pretrained(tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    partition_model(model, {"lm_head.weight": PartitionSpec(2, "mod")})
    assert_same_logits(model, reference)


@pytest.mark.parametrize("case", ["gpt2-mod", "bert-tied-bias", "bert-axis1"])
def test_training_and_greedy_generation_match_the_stock_model(case) -> None:
    model, reference, ties = partitioned(case)
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for step in range(3):
            labels = IDS.roll(step + 1, 1)
            opt.zero_grad()
            m(IDS, labels=labels).loss.backward()
            opt.step()
    assert_same_logits(model, reference, atol=1e-5)
    found = sharded_parameters(model)
    assert found[ties[0]].variables == found[ties[1]].variables  # still tied after training
    if case.startswith("gpt2"):
        prompt, mask = IDS[:, :3], torch.ones(2, 3, dtype=torch.long)
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        ref = reference.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("case", ["gpt2-mod", "bert-axis1"])
def test_a_shardvar_checkpoint_restores_into_the_stock_model(case, tmp_path) -> None:
    model, _, ties = partitioned(case)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # something the stock model does not have yet
    shardvar.save({"model": model}, tmp_path)
    stock = CASES[case][0]()
    shardvar.load({"model": stock}, tmp_path)
    assert_same_logits(stock, model)
    assert_tied(stock, ties)


@pytest.mark.parametrize("case", ["gpt2-div", "bert-axis1"])
def test_resize_and_tie_weights_refuse_and_change_nothing(case) -> None:
    model, reference, _ = partitioned(case)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"resize_token_embeddings\(\) cannot change a partitioned model: resize"):
        model.resize_token_embeddings(VOCAB + 8)
    with pytest.raises(TypeError, match=r"tie_weights\(\) cannot change a partitioned model: tied parameters"):
        model.tie_weights()
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert model.get_input_embeddings().num_embeddings == VOCAB
    assert_same_logits(model, reference)
    assert type(reference).resize_token_embeddings is not None  # the stock class is untouched
    reference.resize_token_embeddings(VOCAB + 8)


@pytest.mark.parametrize("case", ["gpt2-mod", "bert-axis1"])
def test_deepcopy_and_dtype_conversion_of_a_partitioned_model(case) -> None:
    model, reference, ties = partitioned(case)
    clone = copy.deepcopy(model)
    assert_same_logits(clone, reference)
    found = sharded_parameters(clone)
    assert found[ties[0]].variables == found[ties[1]].variables  # the copy is tied to its own shards
    assert not set(map(id, found[ties[0]].variables)) & set(map(id, sharded_parameters(model)[ties[0]].variables))
    clone.double()
    torch.testing.assert_close(clone(IDS).logits, reference.double()(IDS).logits)
    assert clone.state_dict()[ties[0]].dtype == torch.float64
