"""Models by name, with the inputs and loss of a training step, and nothing downloaded.

    zoo:gpt2                 GPT-2 small (zoo:gpt2:n_layer=2,n_embd=256 to resize)
    zoo:llama                a small Llama (RMSNorm, SwiGLU, RoPE, GQA); presets zoo:llama-7b,
                             zoo:llama3-8b, zoo:llama-70b, zoo:llama3-70b, zoo:llama3-405b;
                             zoo:llama:dim=1024,n_layers=4 to resize
    torchvision:NAME         any torchvision.models name, random init
    timm:NAME                any timm model name, random init
    hf:CONFIG_CLASS          a transformers config class with its defaults (hf:BertConfig),
                             options as hf:LlamaConfig:num_hidden_layers=2
    path/to/config.json      a local transformers config (or a folder holding config.json)
    path/to/file.py:fn       fn() returns an nn.Module; give inputs with --input
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..capture.model import Spec, spec as make_spec
from ..errors import SpecError

__all__ = ["ModelSpec", "resolve", "parse_input", "ZOO", "FORMS"]

FORMS = __doc__.split("\n\n", 1)[1]


@dataclass
class ModelSpec:
    """A model ready to profile: how to build it, its inputs and its loss."""

    name: str
    build: Callable[[], nn.Module]
    inputs: tuple = ()
    input_kwargs: dict = field(default_factory=dict)
    loss_fn: Callable | None = None


def parse_input(text: str) -> Spec:
    """'4,128' -> spec((4, 128)); '4,128:int64' -> spec((4, 128), dtype=int64)."""
    shape, _, dtype = text.partition(":")
    try:
        dims = tuple(int(float(s)) for s in shape.replace("x", ",").split(",") if s.strip())
        return make_spec(dims, dtype=dtype or "float32")
    except ValueError as e:
        raise SpecError(f"cannot read input {text!r} ({e}); write a shape like 4,128 or "
                        "4,128:int64") from None


def _options(text: str) -> dict:
    """'n_layer=2,bias=false,eps=1e-6' -> {'n_layer': 2, 'bias': False, 'eps': 1e-06}"""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep:
            raise SpecError(f"option {item!r} should be name=value")
        out[k.strip()] = _value(v.strip())
    return out


def _value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def _with_options(config, options: dict, what: str):
    names = {f.name for f in fields(config)}
    bad = set(options) - names
    if bad:
        raise SpecError(f"{what} has no option {', '.join(sorted(bad))}; options: {', '.join(sorted(names))}")
    return replace(config, **options)


# ---- zoo ----------------------------------------------------------------------------------------

def _check_seq(name: str, options: dict, seq, key: str, limit: int, peers: str = "") -> None:
    """The model refuses a longer sequence in its forward, the same for every size and layout:
    refuse it here, once, with the override that accepts it and `peers`, presets that take it."""
    if seq is not None and seq > limit:
        ask = f"{name}:" + ",".join(f"{k}={v}" for k, v in {**options, key: seq}.items()) + peers
        raise SpecError(f"--seq {seq} exceeds {name}'s {key} {limit} (its forward refuses longer "
                        f"sequences); to train at {seq}, ask for the model with that limit: {ask}")


def _gpt2(name, options, batch, seq):
    from .gpt2 import GPT2, GPT2Config

    c = _with_options(GPT2Config(), options, name)
    _check_seq(name, options, seq, "block_size", c.block_size)
    seq = seq or c.block_size
    tokens = make_spec((batch or 8, seq), dtype=torch.int64, high=c.vocab_size, dims=("batch", "seq"))
    return ModelSpec(name, lambda: GPT2(c), (tokens, tokens))


def _llama(name, options, batch, seq):
    from .llama import PRESETS, Llama

    base = PRESETS[name.split(":", 1)[1]]
    c = _with_options(base, options, name)
    _check_seq(name, options, seq, "max_seq_len", c.max_seq_len, _llama_peers(c, seq))
    seq = seq or min(c.max_seq_len, 2048)
    tokens = make_spec((batch or 4, seq), dtype=torch.int64, high=c.vocab_size, dims=("batch", "seq"))
    return ModelSpec(name, lambda: Llama(c), (tokens, tokens))


ZOO = {"gpt2": _gpt2, **{k: _llama for k in ("llama", "llama-7b", "llama3-8b", "llama-70b", "llama3-70b", "llama3-405b")}}


def _classification_loss(out, *inputs):
    """Cross-entropy against class 0 for every sample (labels made inside the step)."""
    if not isinstance(out, torch.Tensor):  # some models return (logits, aux)
        out = out[0] if isinstance(out, (tuple, list)) else out.logits
    return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long, device=out.device))


def _llama_peers(c, seq) -> str:
    """The presets of the same depth and width as `c` that take `seq` tokens (Llama 2 70B's
    refusal of 8,192 names Llama 3 70B, trained at that length), as the refusal's tail."""
    from .llama import PRESETS

    if seq is None:
        return ""
    same = [f"zoo:{k} (the same {c.n_layers} layers x {c.dim:,} wide, vocabulary {p.vocab_size:,}, "
            f"max_seq_len {p.max_seq_len:,})" for k, p in PRESETS.items()
            if (p.dim, p.n_layers, p.n_heads) == (c.dim, c.n_layers, c.n_heads)
            and p.max_seq_len >= seq]
    return "".join(f", or {x}" for x in same)


def _torchvision(name, options, batch, seq):
    try:
        import torchvision.models as tvm
    except ImportError:
        raise SpecError("torchvision is not installed: pip install torchvision") from None
    model = name.split(":", 1)[1]
    known = tvm.list_models()
    if model not in known:
        raise SpecError(f"torchvision has no model {model!r}" + _suggest(model, known))
    size = 224
    try:
        weights = tvm.get_model_weights(model)
        crop = next(iter(weights)).transforms().crop_size
        size = crop[0] if isinstance(crop, (list, tuple)) else int(crop)
    except Exception:  # noqa: BLE001 - models without weights enums keep 224
        pass
    if model in ("inception_v3", "googlenet"):
        options = {"aux_logits": False, "init_weights": False, **options}
    size = seq or size
    image = make_spec((batch or 32, 3, size, size), dims=("batch", None, "size", "size"))
    return ModelSpec(name, lambda: tvm.get_model(model, weights=None, **options), (image,),
                     loss_fn=_classification_loss)


def _timm(name, options, batch, seq):
    try:
        import timm
    except ImportError:
        raise SpecError("timm is not installed: pip install timm") from None
    model = name.split(":", 1)[1]
    if not timm.is_model(model):
        raise SpecError(f"timm has no model {model!r}" + _suggest(model, timm.list_models()))
    cfg = timm.get_pretrained_cfg(model)
    size = tuple(cfg.input_size) if cfg is not None else (3, 224, 224)
    if seq:
        size = (size[0], seq, seq)
    image = make_spec((batch or 32, *size), dims=("batch", None, "size", "size"))
    return ModelSpec(name, lambda: timm.create_model(model, pretrained=False, **options), (image,),
                     loss_fn=_classification_loss)


def _hf_config(name, options):
    try:
        import transformers
    except ImportError:
        raise SpecError("transformers is not installed: pip install transformers") from None
    if name.startswith("hf:"):
        cls_name = name.split(":", 1)[1]
        cls = getattr(transformers, cls_name, None)
        if cls is None or not isinstance(cls, type) or not issubclass(cls, transformers.PretrainedConfig):
            known = [n for n in dir(transformers) if n.endswith("Config") and n[0].isupper()]
            raise SpecError(f"transformers has no config class {cls_name!r}" + _suggest(cls_name, known))
        try:
            config = cls(**options)
        except Exception as e:  # noqa: BLE001 - transformers validates options its own way
            raise SpecError(f"{cls_name} refused the options {options}: {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0]} (options are name=value, separated "
                            f"by commas: hf:{cls_name}:num_hidden_layers=2,hidden_size=256)") from None
    else:
        file = os.path.join(name, "config.json") if os.path.isdir(name) else name
        try:
            with open(file) as f:
                values = json.load(f)
            config = transformers.AutoConfig.for_model(values.pop("model_type"), **values, **options)
        except (OSError, ValueError, KeyError) as e:
            raise SpecError(f"cannot read a transformers config from {file}: {e}") from None
    return transformers, config


def _hf(name, options, batch, seq):
    transformers, config = _hf_config(name, options)
    auto = transformers
    vision = hasattr(config, "image_size") and hasattr(config, "num_channels") \
        and not hasattr(config, "vocab_size")
    if vision:
        heads = [auto.AutoModelForImageClassification, auto.AutoModel]
    elif getattr(config, "is_encoder_decoder", False):
        heads = [auto.AutoModelForSeq2SeqLM, auto.AutoModelForCausalLM, auto.AutoModel]
    elif type(config) in auto.AutoModelForMaskedLM._model_mapping.keys() and \
            not getattr(config, "is_decoder", False):
        heads = [auto.AutoModelForMaskedLM]  # an encoder (BERT & co): trained as a masked LM
    else:
        heads = [auto.AutoModelForCausalLM, auto.AutoModelForMaskedLM, auto.AutoModel]
    for head in heads:
        if type(config) in head._model_mapping.keys():
            chosen = head
            break
    else:
        raise SpecError(f"transformers has no model for {type(config).__name__}")
    label = f"{name} ({chosen.__name__[len('AutoModel'):].replace('For', '') or 'base'})"
    if vision:
        size = seq or config.image_size
        size = size[0] if isinstance(size, (list, tuple)) else size
        image = make_spec((batch or 32, config.num_channels, size, size),
                          dims=("batch", None, "size", "size"))
        if chosen is auto.AutoModel:
            return ModelSpec(label, lambda: chosen.from_config(config), (image,))
        labels = make_spec((batch or 32,), dtype=torch.int64, high=config.num_labels,
                           dims=("batch",))
        return ModelSpec(label, lambda: chosen.from_config(config), (image,), {"labels": labels})
    if getattr(config, "is_encoder_decoder", False) and \
            getattr(config, "decoder_start_token_id", None) is None:
        # The model shifts the labels right to make the decoder's input, starting with this
        # token; a default config may leave it unset (T5's published configs use the pad token)
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = seq or min(512, max_pos or 512)
    vocab = getattr(config, "vocab_size", None) or 1000
    tokens = make_spec((batch or 8, seq), dtype=torch.int64, high=vocab, dims=("batch", "seq"))
    kwargs = {"labels": tokens} if chosen is not auto.AutoModel else {}
    return ModelSpec(label, lambda: chosen.from_config(config), (tokens,), kwargs)


def _file(name, options, batch, seq):
    from ..loading import load_function

    build = load_function(name, "model builder")
    path, _, fn = name.rpartition(":")
    return ModelSpec(f"{os.path.basename(path)}:{fn}", lambda: build(**options))


def _suggest(word, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=3)
    return f"; did you mean {', '.join(close)}?" if close else ""


def resolve(text: str, batch: int | None = None, seq: int | None = None,
            inputs: list[Spec] | None = None) -> ModelSpec:
    """A ModelSpec from a spec string (see FORMS). `inputs` replaces the derived inputs."""
    for flag, n in (("--batch", batch), ("--seq", seq)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise SpecError(f"{flag} must be a whole number of at least 1, got {n!r}")
    text = text.strip()
    options: dict = {}
    if text.startswith("zoo:"):
        parts = text.split(":", 2)
        if parts[1] not in ZOO:
            raise SpecError(f"no zoo model {parts[1]!r}; the zoo has {', '.join(ZOO)}")
        if len(parts) == 3:
            options = _options(parts[2])
        m = ZOO[parts[1]](f"zoo:{parts[1]}", options, batch, seq)
    elif text.startswith(("torchvision:", "timm:", "hf:")):
        prefix, rest = text.split(":", 1)
        name, _, opts = rest.partition(":")
        options = _options(opts)
        m = {"torchvision": _torchvision, "timm": _timm, "hf": _hf}[prefix](
            f"{prefix}:{name}", options, batch, seq)
    elif text.endswith(".json") or os.path.isdir(text):
        m = _hf(text, options, batch, seq)
    elif ".py:" in text:
        path, _, fn = text.rpartition(":")
        m = _file(text, options, batch, seq)
        if not inputs:
            raise SpecError(f"{text}: give the model's input shapes with --input, e.g. --input 8,3,224,224 "
                            "(repeat for several inputs; --input 8,128:int64 for a dtype)")
    else:
        raise SpecError(f"cannot understand model spec {text!r}. Accepted forms:\n{FORMS}")
    if inputs:
        m.inputs, m.input_kwargs = tuple(inputs), {}
    return m
