"""Model specs: every accepted form builds and traces, with no download."""

import json

import pytest

import tapescope
from tapescope.zoo import parse_input, resolve

from .conftest import profile_spec


@pytest.mark.parametrize("spec,batch,seq", [
    ("zoo:llama:dim=64,n_layers=1,n_heads=4,n_kv_heads=1,ffn_dim=128,vocab_size=64", 2, 16),
    ("torchvision:mobilenet_v3_small", 2, 64),
    ("timm:resnet18", 2, 64),
    ("hf:BertConfig:num_hidden_layers=1,hidden_size=64,num_attention_heads=2,intermediate_size=128,vocab_size=100", 2, 16),
    ("hf:GPT2Config:n_layer=1,n_embd=64,n_head=2,vocab_size=100", 2, 16),
    ("hf:DistilBertConfig:n_layers=1,dim=32,hidden_dim=64,n_heads=2,vocab_size=100", 2, 16),
    ("hf:T5Config:num_layers=1,num_decoder_layers=1,d_model=32,d_kv=8,d_ff=64,num_heads=2,"
     "vocab_size=100", 2, 16),
    ("hf:ViTConfig:num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,"
     "image_size=32,patch_size=8", 2, None),
])
def test_specs_trace(spec, batch, seq):
    p = profile_spec(resolve(spec, batch=batch, seq=seq), steps=1)
    assert p.peak_bytes > 0 and p.flops["total"] > 0


def test_local_config_json(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for spec in (str(tmp_path / "config.json"), str(tmp_path)):
        m = resolve(spec, batch=1, seq=8)
        assert "CausalLM" in m.name
        assert profile_spec(m, steps=1).peak_bytes > 0


def test_inputs_parse():
    s = parse_input("4,128:int64")
    assert s.shape == (4, 128) and str(s.dtype) == "torch.int64"
    assert parse_input("8x3x224x224").shape == (8, 3, 224, 224)


def test_presets_are_big():
    m = resolve("zoo:llama-70b", batch=1, seq=8)
    p = tapescope.profile(m.build, *m.inputs, optimizer=None, steps=1)
    assert 68e9 < p.facts["parameters"] < 71e9


def test_hf_heads_and_inputs_follow_the_config():
    """An encoder trains as a masked LM, a decoder as a causal LM, a vision config classifies
    images; the inputs are made to match."""
    bert = resolve("hf:BertConfig:num_hidden_layers=1,hidden_size=64,num_attention_heads=2,"
                   "intermediate_size=128,vocab_size=100", batch=2, seq=8)
    assert "MaskedLM" in bert.name and bert.inputs[0].shape == (2, 8)
    vit = resolve("hf:ViTConfig:num_hidden_layers=1,hidden_size=32,num_attention_heads=2,"
                  "intermediate_size=64,image_size=32,patch_size=8", batch=2)
    assert "ImageClassification" in vit.name and vit.inputs[0].shape == (2, 3, 32, 32)
    assert vit.input_kwargs["labels"].shape == (2,)


def test_hf_option_errors_are_clear():
    with pytest.raises(tapescope.TapescopeError, match="separated by commas"):
        resolve("hf:LlamaConfig:num_hidden_layers=2:hidden_size=256")


def test_llama3_70b_preset_has_the_published_shape():
    """Llama 3 70B (Dubey et al. 2024, Table 3): its parameter count from the shape by hand -
    untied embedding and output 2 x 128,256 x 8,192; per layer q and o 8,192^2 each, k and v
    8,192 x 1,024 each (8 KV heads of 128), SwiGLU 3 x 8,192 x 28,672, two norms; a final norm -
    is 70,553,706,496, the count Meta publishes for Meta-Llama-3-70B."""
    import torch

    by_hand = 2 * 128256 * 8192 + 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672
                                        + 2 * 8192) + 8192
    assert by_hand == 70_553_706_496
    m = resolve("zoo:llama3-70b", batch=1, seq=8192)
    assert m.inputs[0].shape == (1, 8192)
    with torch.device("meta"):
        model = m.build()
    assert sum(p.numel() for p in model.parameters()) == by_hand
    assert model.config.rope_theta == 500000.0 and model.config.max_seq_len == 8192


def test_a_longer_sequence_names_the_preset_that_takes_it():
    """Llama 2 70B stops at 4,096 tokens: the refusal offers the override and Llama 3 70B."""
    with pytest.raises(tapescope.TapescopeError) as e:
        resolve("zoo:llama-70b", batch=1, seq=8192)
    assert "zoo:llama-70b:max_seq_len=8192" in str(e.value)
    assert "zoo:llama3-70b" in str(e.value)
    with pytest.raises(tapescope.TapescopeError) as e:  # no preset of this size takes 16,384
        resolve("zoo:llama-70b", batch=1, seq=16384)
    assert "zoo:llama3-70b" not in str(e.value)
