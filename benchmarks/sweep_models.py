"""The models of benchmarks/sweep.py: every family tapescope is meant for, at small sizes.

Each row is a family, a name and a function that returns a `tapescope.zoo.ModelSpec` (how to
build the model, its inputs, its loss) plus options for `profile` (a routing assumption,
gradient accumulation). Built from configs, random weights, nothing downloaded. Rows whose inputs
carry values the real run must respect (token ids below the vocabulary, detection boxes, a routing
code) give real tensors, whose values the fake trace never reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tapescope.capture.model import spec
from tapescope.zoo import ModelSpec, resolve

__all__ = ["Row", "ROWS"]


@dataclass
class Row:
    family: str
    name: str
    make: Callable[[], ModelSpec]
    shape: str = ""                       # what "batch x seq" means for the table
    options: dict = field(default_factory=dict)   # extra keywords for profile / run_real_steps


def _zoo(text, batch, seq, **options):
    return lambda: resolve(text, batch=batch, seq=seq)


def _row(family, text, batch=2, seq=32, **options):
    name = text.split(":")[0] + ":" + text.split(":")[1]
    return Row(family, name, _zoo(text, batch, seq), f"{batch} x {seq}", options)


LM = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,vocab_size=256"
KV = LM + ",num_key_value_heads=2"
ENC = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,vocab_size=256"
MOE = ("num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
       "vocab_size=256")

# ---- transformers: language models, encoders, encoder-decoders ------------------------------------

ROWS: list[Row] = [
    _row("hf LM", f"hf:GPT2Config:n_layer=2,n_embd=64,n_head=4,vocab_size=256"),
    _row("hf LM", f"hf:LlamaConfig:{KV}"),
    _row("hf LM", f"hf:MistralConfig:{KV}"),
    _row("hf LM", f"hf:Qwen2Config:{KV}"),
    _row("hf LM", f"hf:GPTNeoXConfig:{LM}"),
    _row("hf LM", f"hf:PhiConfig:{LM}"),
    _row("hf LM", f"hf:Phi3Config:{KV},pad_token_id=0"),
    _row("hf LM", f"hf:GemmaConfig:{KV},head_dim=16"),
    _row("hf LM", f"hf:Gemma2Config:{KV},head_dim=16"),
    _row("hf LM", f"hf:FalconConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
                  "vocab_size=256"),
    _row("hf LM", f"hf:OPTConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
                  "ffn_dim=128,vocab_size=256,word_embed_proj_dim=64"),
    _row("hf LM", "hf:BloomConfig:n_layer=2,hidden_size=64,n_head=4,vocab_size=256"),
    _row("hf LM", "hf:GPTJConfig:n_layer=2,n_embd=64,n_head=4,rotary_dim=8,vocab_size=256"),
    _row("hf LM", f"hf:StableLmConfig:{KV}"),
    _row("hf LM", f"hf:Starcoder2Config:{KV}"),
    _row("hf LM", f"hf:OlmoConfig:{KV}"),
    _row("hf LM", "hf:GPTBigCodeConfig:n_layer=2,n_embd=64,n_head=4,vocab_size=256"),
    _row("hf LM", "hf:CodeGenConfig:n_layer=2,n_embd=64,n_head=4,rotary_dim=8,vocab_size=256"),
    _row("hf encoder", f"hf:BertConfig:{ENC}"),
    _row("hf encoder", f"hf:RobertaConfig:{ENC}"),
    _row("hf encoder", "hf:DistilBertConfig:n_layers=2,dim=64,hidden_dim=128,n_heads=4,"
                       "vocab_size=256"),
    _row("hf encoder", f"hf:AlbertConfig:{ENC},embedding_size=32"),
    _row("hf encoder", f"hf:ElectraConfig:{ENC},embedding_size=32"),
    _row("hf encoder", f"hf:DebertaV2Config:{ENC}"),
    _row("hf encoder", f"hf:MPNetConfig:{ENC}"),
    _row("hf encoder", f"hf:ModernBertConfig:{ENC},global_attn_every_n_layers=2,pad_token_id=0,"
                       "bos_token_id=1,eos_token_id=2,cls_token_id=1,sep_token_id=2"),
    _row("hf seq2seq", "hf:T5Config:num_layers=2,num_decoder_layers=2,d_model=64,d_kv=16,"
                       "d_ff=128,num_heads=4,vocab_size=256"),
    _row("hf seq2seq", "hf:BartConfig:encoder_layers=2,decoder_layers=2,d_model=64,"
                       "encoder_attention_heads=4,decoder_attention_heads=4,encoder_ffn_dim=128,"
                       "decoder_ffn_dim=128,vocab_size=256"),
]

# ---- transformers: audio and vision ------------------------------------------------------------------


def _ctc(config_cls, model_cls, layerdrop=0.0):
    def make():
        import transformers

        config = getattr(transformers, config_cls)(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), vocab_size=32,
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
            ctc_loss_reduction="mean",
            # LayerDrop draws a random number per layer and skips the layer on it: tapescope
            # takes each draw at its median (no layer dropped), and the real run of that row is
            # the seed whose draws dropped none (`keep_layers`). SpecAugment masks a random
            # number of frames: off, as for a measurement
            layerdrop=layerdrop, mask_time_prob=0.0)
        labels = torch.randint(1, 32, (2, 8))
        return ModelSpec(model_cls, lambda: getattr(transformers, model_cls)(config),
                         (spec((2, 4000)),), {"labels": labels})
    return make


def _whisper():
    import transformers

    config = transformers.WhisperConfig(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
        max_source_positions=32, max_target_positions=32, vocab_size=256)
    labels = torch.randint(0, 256, (2, 8))
    return ModelSpec("Whisper", lambda: transformers.WhisperForConditionalGeneration(config),
                     (spec((2, 16, 64)),), {"labels": labels})


def _encodec():
    """Encodec pads every convolution by amounts computed from 0-dim int64 buffers."""
    import transformers

    config = transformers.EncodecConfig(
        hidden_size=16, num_filters=4, upsampling_ratios=[2, 2], codebook_size=16,
        num_lstm_layers=1, target_bandwidths=[1.5], sampling_rate=800, num_residual_layers=1)
    return ModelSpec("Encodec", lambda: transformers.EncodecModel(config), (spec((2, 1, 400)),),
                     loss_fn=lambda out, *inputs: out.audio_values.pow(2).mean())


def _hf_vision(config_cls, **options):
    """An image classifier from a config whose options are lists (which a spec string cannot
    carry)."""
    def make():
        import transformers

        config = getattr(transformers, config_cls)(num_labels=4, **options)
        labels = spec((2,), dtype=torch.int64, high=4)
        return ModelSpec(f"hf:{config_cls}",
                         lambda: transformers.AutoModelForImageClassification.from_config(config),
                         (spec((2, 3, 32, 32)),), {"labels": labels})
    return make


ROWS += [
    Row("hf audio", "hf:Wav2Vec2ForCTC (layerdrop=0, mask_time_prob=0)", _ctc("Wav2Vec2Config", "Wav2Vec2ForCTC"),
        "2 x 4000"),
    Row("hf audio", "hf:HubertForCTC (layerdrop=0, mask_time_prob=0)", _ctc("HubertConfig", "HubertForCTC"),
        "2 x 4000"),
    Row("hf audio", "hf:Wav2Vec2ForCTC (default layerdrop)",
        _ctc("Wav2Vec2Config", "Wav2Vec2ForCTC", layerdrop=0.1), "2 x 4000",
        {"keep_layers": "wav2vec2.encoder.layers"}),
    Row("hf audio", "hf:WhisperForConditionalGeneration", _whisper, "2 x 16x64 mel"),
    Row("hf audio", "hf:EncodecModel", _encodec, "2 x 1x400"),
    _row("hf vision", "hf:ViTConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
                      "intermediate_size=128,image_size=32,patch_size=8", batch=2, seq=None),
    Row("hf vision", "hf:SwinConfig", _hf_vision("SwinConfig", embed_dim=16, depths=[1, 1],
                                                 num_heads=[2, 2], image_size=32, patch_size=4,
                                                 window_size=4), "2 x 32"),
    Row("hf vision", "hf:ConvNextConfig", _hf_vision("ConvNextConfig", num_stages=2,
                                                     hidden_sizes=[16, 32], depths=[1, 1],
                                                     image_size=32), "2 x 32"),
]

# ---- transformers: mixtures of experts, state-space models -------------------------------------------

ROWS += [
    _row("hf MoE", f"hf:MixtralConfig:{MOE},intermediate_size=128,num_local_experts=4,"
                   "num_experts_per_tok=2"),
    Row("hf MoE", "hf:MixtralConfig (eager experts)",
        _zoo(f"hf:MixtralConfig:{MOE},intermediate_size=128,num_local_experts=4,"
             "num_experts_per_tok=2,experts_implementation=eager", 2, 32), "2 x 32",
        {"forced_routing": "balanced"}),
    Row("hf MoE", "hf:MixtralConfig (eager, worst routing)",
        _zoo(f"hf:MixtralConfig:{MOE},intermediate_size=128,num_local_experts=4,"
             "num_experts_per_tok=2,experts_implementation=eager", 2, 32), "2 x 32",
        {"sizes": "worst", "forced_routing": "worst"}),
    _row("hf MoE", f"hf:Qwen2MoeConfig:{MOE},intermediate_size=128,moe_intermediate_size=32,"
                   "shared_expert_intermediate_size=64,num_experts=4,num_experts_per_tok=2"),
    _row("hf MoE", f"hf:Qwen3MoeConfig:{MOE},intermediate_size=128,moe_intermediate_size=32,"
                   "num_experts=4,num_experts_per_tok=2,head_dim=16"),
    _row("hf MoE", f"hf:OlmoeConfig:{MOE},intermediate_size=128,num_experts=4,"
                   "num_experts_per_tok=2"),
    _row("hf MoE", f"hf:DeepseekV3Config:{MOE},intermediate_size=128,moe_intermediate_size=32,"
                   "n_routed_experts=4,num_experts_per_tok=2,n_shared_experts=1,"
                   "first_k_dense_replace=1,n_group=1,topk_group=1,q_lora_rank=32,kv_lora_rank=16,"
                   "qk_rope_head_dim=8,qk_nope_head_dim=8,v_head_dim=16"),
    _row("hf SSM", "hf:MambaConfig:hidden_size=32,num_hidden_layers=2,vocab_size=256,"
                   "state_size=8", seq=16),
    _row("hf SSM", "hf:Mamba2Config:hidden_size=64,num_hidden_layers=2,vocab_size=256,"
                   "state_size=8,num_heads=4,head_dim=32,n_groups=1,chunk_size=16", seq=16),
]

# ---- torchvision (classification, detection, segmentation), timm -------------------------------------


def _detection(name):
    def make():
        import torchvision.models.detection as det

        builder = getattr(det, name)
        images = [torch.rand(3, 128, 128), torch.rand(3, 128, 128)]
        targets = [{"boxes": torch.tensor([[10.0, 20.0, 60.0, 90.0], [30.0, 30.0, 100.0, 120.0]]),
                    "labels": torch.tensor([1, 2])} for _ in images]
        return ModelSpec(f"torchvision:{name}",
                         # images kept at 128 (the transform would resize them to 320 or 800:
                         # RetinaNet's real step at 800 did not finish in 25 min on 2 cores)
                         lambda: builder(weights=None, weights_backbone=None, num_classes=3,
                                         min_size=128, max_size=128),
                         (images, targets), loss_fn=lambda out, *inputs: sum(out.values()))
    return make


def _segmentation(name):
    def make():
        import torchvision.models.segmentation as seg

        return ModelSpec(f"torchvision:{name}",
                         lambda: getattr(seg, name)(weights=None, weights_backbone=None,
                                                    num_classes=4, aux_loss=False),
                         (spec((2, 3, 64, 64)),),
                         loss_fn=lambda out, *inputs: out["out"].logsumexp(1).mean())
    return make


ROWS += [_row("torchvision", f"torchvision:{n}", batch=2, seq=64) for n in (
    "resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "swin_t",
    "densenet121", "regnet_y_400mf", "squeezenet1_0", "shufflenet_v2_x0_5", "mnasnet0_5")]
ROWS += [
    _row("torchvision", "torchvision:vit_b_16", batch=1, seq=224),
    _row("torchvision", "torchvision:googlenet", batch=2, seq=64),
    # the RPN's proposals after NMS come from the network's outputs: the mask assumption sizes them
    Row("torchvision detection", "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn",
        _detection("fasterrcnn_mobilenet_v3_large_320_fpn"), "2 x 128", {"sizes": {"mask": 0.5}}),
    Row("torchvision detection", "torchvision:retinanet_resnet50_fpn",
        _detection("retinanet_resnet50_fpn"), "2 x 128"),
    Row("torchvision segmentation", "torchvision:lraspp_mobilenet_v3_large",
        _segmentation("lraspp_mobilenet_v3_large"), "2 x 64"),
    Row("torchvision segmentation", "torchvision:deeplabv3_mobilenet_v3_large",
        _segmentation("deeplabv3_mobilenet_v3_large"), "2 x 64"),
]
ROWS += [_row("timm", f"timm:{n}", batch=2, seq=s) for n, s in (
    ("resnet26d", 64), ("deit_tiny_patch16_224", None), ("convnext_atto", 64),
    ("efficientnet_b0", 64), ("levit_128s", None), ("regnetx_002", 64),
    ("vit_tiny_patch16_224", None), ("mixer_s16_224", None))]

# ---- recurrent networks, plain PyTorch programs -------------------------------------------------------


class _RNNLM(nn.Module):
    def __init__(self, cell, bidirectional=False):
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.rnn = getattr(nn, cell)(32, 48, num_layers=2, batch_first=True,
                                     bidirectional=bidirectional)
        self.head = nn.Linear(96 if bidirectional else 48, 256)

    def forward(self, tokens):
        h, _ = self.rnn(self.emb(tokens))
        return F.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def _rnn(cell, bidirectional=False):
    tokens = spec((4, 24), dtype=torch.int64, high=256)
    return lambda: ModelSpec(cell, lambda: _RNNLM(cell, bidirectional), (tokens,))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256),
                                 nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x):
        return F.cross_entropy(self.net(x), torch.zeros(x.shape[0], dtype=torch.long))


class _SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return F.cross_entropy(self.fc(self.features(x).flatten(1)),
                               torch.zeros(x.shape[0], dtype=torch.long))


class _Seq2Seq(nn.Module):
    """nn.Transformer on embedded tokens, teacher forcing."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.t = nn.Transformer(64, 4, 2, 2, 128, batch_first=True)
        self.head = nn.Linear(64, 256)

    def forward(self, src, tgt):
        mask = self.t.generate_square_subsequent_mask(tgt.shape[1])
        h = self.t(self.emb(src), self.emb(tgt), tgt_mask=mask)
        return F.cross_entropy(self.head(h).flatten(0, 1), tgt.flatten())


class _ConvAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
                                 nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.dec = nn.Sequential(nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.ReLU(),
                                 nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1), nn.Sigmoid())

    def forward(self, x):
        return F.mse_loss(self.dec(self.enc(x)), x)


class _RecSys(nn.Module):
    """Embedding bags of sparse features and a dense MLP (a DLRM-like click model)."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(1000, 16, mode="sum") for _ in range(3))
        self.mlp = nn.Sequential(nn.Linear(3 * 16 + 8, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids, dense):
        feats = [bag(ids[:, i]) for i, bag in enumerate(self.bags)]
        logit = self.mlp(torch.cat(feats + [dense], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logit, torch.ones_like(logit))


class _WeightNormNet(nn.Module):
    """Parametrized layers: weight_norm and spectral_norm (torch.nn.utils.parametrizations)."""

    def __init__(self):
        super().__init__()
        p = torch.nn.utils.parametrizations
        self.a = p.weight_norm(nn.Linear(32, 64))
        self.b = p.spectral_norm(nn.Linear(64, 64))
        self.c = nn.Linear(64, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))).pow(2).mean()


def _plain(name, cls, *inputs):
    return Row("plain PyTorch", name, lambda: ModelSpec(name, cls, inputs),
               " x ".join("x".join(map(str, i.shape)) for i in inputs))


ROWS += [
    Row("RNN", "nn.LSTM language model", _rnn("LSTM"), "4 x 24"),
    Row("RNN", "nn.LSTM bidirectional", _rnn("LSTM", True), "4 x 24"),
    Row("RNN", "nn.GRU language model", _rnn("GRU"), "4 x 24"),
    Row("RNN", "nn.RNN language model", _rnn("RNN"), "4 x 24"),
    _plain("MLP", _MLP, spec((32, 64))),
    _plain("small CNN", _SmallCNN, spec((8, 3, 32, 32))),
    _plain("nn.Transformer seq2seq", _Seq2Seq, spec((4, 16), dtype=torch.int64, high=256),
           spec((4, 12), dtype=torch.int64, high=256)),
    _plain("conv autoencoder", _ConvAutoencoder, spec((8, 1, 32, 32))),
    _plain("embedding-bag click model", _RecSys, spec((16, 3, 4), dtype=torch.int64, high=1000),
           spec((16, 8))),
    _plain("weight_norm + spectral_norm MLP", _WeightNormNet, spec((16, 32))),
    Row("accumulation", "hf:GPT2Config, --accumulate 4",
        _zoo("hf:GPT2Config:n_layer=2,n_embd=64,n_head=4,vocab_size=256", 2, 32), "2 x 32",
        {"accumulate": 4}),
    Row("accumulation", "small CNN, --accumulate 4",
        lambda: ModelSpec("small CNN", _SmallCNN, (spec((8, 3, 32, 32)),)), "8 x 3x32x32",
        {"accumulate": 4}),
]

# ---- the rows an AVX-512 host first showed off (issue 23), at reduced sizes ----------------------------


def _channels_last(name, make_spec):
    """A model and its image input in channels-last memory format, as `model.to(memory_format=
    torch.channels_last)` training scripts run it."""
    def make():
        m = make_spec()
        build = m.build

        def build_cl():
            return build().to(memory_format=torch.channels_last)
        return ModelSpec(name, build_cl, m.inputs, m.input_kwargs, m.loss_fn)
    return make


class _DCGANGenerator(nn.Module):
    """DCGAN's generator (Radford et al.): transposed convolutions up from a latent, mse against
    a target image."""

    def __init__(self, nz=32, ngf=16):
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2),
            nn.ReLU(),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(),
            nn.ConvTranspose2d(ngf, 3, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, z):
        out = self.net(z)
        return F.mse_loss(out, torch.zeros_like(out))


class _HiFiGANBlock(nn.Module):
    """HiFi-GAN's generator pattern: a 1-D transposed-convolution upsampler and dilated 1-D
    residual convolutions (leaky ReLU), L1 against a waveform."""

    def __init__(self, c=32):
        super().__init__()
        self.pre = nn.Conv1d(16, c, 7, padding=3)
        self.up = nn.ConvTranspose1d(c, c // 2, 16, 8, padding=4)
        self.res = nn.ModuleList(nn.Conv1d(c // 2, c // 2, 3, dilation=d, padding=d)
                                 for d in (1, 3, 5))
        self.post = nn.Conv1d(c // 2, 1, 7, padding=3)

    def forward(self, mel):
        x = self.up(F.leaky_relu(self.pre(mel), 0.1))
        for conv in self.res:
            x = x + conv(F.leaky_relu(x, 0.1))
        wav = torch.tanh(self.post(F.leaky_relu(x, 0.1)))
        return F.l1_loss(wav, torch.zeros_like(wav))


class _UNet3D(nn.Module):
    """A small 3-D U-Net (volumetric segmentation): Conv3d, max-pool, transposed Conv3d, skip."""

    def __init__(self, c=8):
        super().__init__()
        self.down = nn.Sequential(nn.Conv3d(1, c, 3, padding=1), nn.ReLU(),
                                  nn.Conv3d(c, c, 3, padding=1), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv3d(c, 2 * c, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose3d(2 * c, c, 2, stride=2)
        self.out = nn.Conv3d(2 * c, 3, 1)

    def forward(self, x):
        d = self.down(x)
        m = self.mid(F.max_pool3d(d, 2))
        logits = self.out(torch.cat([self.up(m), d], dim=1))
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], *logits.shape[2:],
                                                   dtype=torch.long))


def _segformer():
    import transformers

    config = transformers.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1],
                                          sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                          patch_sizes=[7, 3], strides=[4, 2],
                                          num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                                          decoder_hidden_size=32, num_labels=4)
    labels = spec((2, 64, 64), dtype=torch.int64, high=4)
    return ModelSpec("hf:SegformerForSemanticSegmentation",
                     lambda: transformers.SegformerForSemanticSegmentation(config),
                     (spec((2, 3, 64, 64)),), {"labels": labels})


class _AutocastGPT(nn.Module):
    """A small GPT whose forward runs under CPU autocast in bf16 (the bf16 matmul kernels)."""

    def __init__(self):
        super().__init__()
        import transformers

        self.gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=256))

    def forward(self, tokens):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.gpt(tokens, labels=tokens).loss


ROWS += [
    Row("hf vision", "hf:ConvNextV2Config", _hf_vision("ConvNextV2Config", num_stages=2,
                                                       hidden_sizes=[16, 32], depths=[1, 1],
                                                       image_size=32), "2 x 32"),
    _row("timm", "timm:edgenext_xx_small", batch=2, seq=64),
    Row("timm", "timm:mobilenetv4_conv_small (channels-last)",
        _channels_last("timm:mobilenetv4_conv_small",
                       _zoo("timm:mobilenetv4_conv_small", 2, 64)), "2 x 64"),
    _row("timm", "timm:eva02_tiny_patch14_224", batch=1, seq=None),
    _row("timm", "timm:dla34", batch=2, seq=64),
    Row("hf vision", "hf:SegformerForSemanticSegmentation", _segformer, "2 x 64"),
    _plain("DCGAN generator", _DCGANGenerator, spec((4, 32, 1, 1))),
    _plain("HiFi-GAN-like upsampler", _HiFiGANBlock, spec((2, 16, 32))),
    _plain("3-D U-Net", _UNet3D, spec((2, 1, 16, 16, 16))),
    _plain("GPT under CPU autocast bf16", _AutocastGPT,
           spec((2, 32), dtype=torch.int64, high=256)),
]
