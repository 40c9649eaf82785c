"""The model: a small byte-level causal transformer with rotary positions and grouped-query attention.

The model never touches KV memory itself. Each layer computes q, k, v (k already rotated to its
position, as real engines store it) and hands them to an *attention backend*: contiguous causal
attention for training, or a paged backend that writes k, v into pool pages and reads them back
only through a block table (`minigrid_engine.attention`). Whatever those pages hold is what the
model attends to: that is the whole incident.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from minigrid_engine.errors import ConfigError

WEIGHTS_FILE = "minigrid-byte.pt"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer. Defaults are the shipped model's."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    rotary_dims: int = 16  # rotary on part of each head: content-only dims help long-range copying
    rope_base: float = 10000.0
    mlp_hidden: int = 384
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.rotary_dims % 2 or self.rotary_dims > self.head_dim:
            raise ConfigError(
                f"rotary_dims {self.rotary_dims} must be even and at most head_dim {self.head_dim}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V one token occupies across all layers (the pool's unit of cost)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * elem


class AttentionBackend(Protocol):
    """Stores this step's k, v for `layer` and returns attention output shaped like q.

    q: [B, T, n_heads, head_dim]; k, v: [B, T, n_kv_heads, head_dim] (k rotated).
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Rotate the first `rotary_dims` of each head by its token position (NeoX half layout).

    x: [B, T, heads, head_dim]; positions: [B, T] integer.
    """
    r = cfg.rotary_dims
    half = r // 2
    inv_freq = cfg.rope_base ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, half]
    cos = angles.cos()[:, :, None, :].to(x.dtype)
    sin = angles.sin()[:, :, None, :].to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:r], x[..., r:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        d, hd = cfg.d_model, cfg.head_dim
        self.wq = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.wq(x).view(b, t, cfg.n_heads, cfg.head_dim)
        k = self.wk(x).view(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(x).view(b, t, cfg.n_kv_heads, cfg.head_dim)
        q = apply_rotary(q, positions, cfg)
        k = apply_rotary(k, positions, cfg)
        out = backend(self.layer, q, k, v)
        return self.wo(out.reshape(b, t, cfg.n_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, backend)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Causal LM over bytes. `forward` returns logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, backend)
        return F.linear(self.norm(x), self.embed.weight)  # tied output head

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def default_weights_path() -> Path:
    """The weights shipped inside the package (made by `python -m minigrid_engine.train`)."""
    return Path(str(resources.files("minigrid_engine") / "weights" / WEIGHTS_FILE))


def save_model(model: Transformer, path: Path, meta: dict[str, object]) -> None:
    """Write weights (float16, to keep the package small), config and training facts."""
    state = {k: v.detach().to(torch.float16) for k, v in model.state_dict().items()}
    torch.save({"config": asdict(model.cfg), "state_dict": state, "meta": meta}, path)


def load_model(path: Path | str | None = None, device: str | torch.device = "cpu") -> Transformer:
    """Load the shipped model (or the file at `path`) in float32, in eval mode, no network."""
    path = Path(path) if path is not None else default_weights_path()
    if not path.exists():
        raise ConfigError(
            f"model weights not found at {path}: run `python -m minigrid_engine.train` to make them"
        )
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = Transformer(ModelConfig(**blob["config"]))
    model.load_state_dict({k: v.to(torch.float32) for k, v in blob["state_dict"].items()})
    return model.to(device).eval()


def load_meta(path: Path | None = None) -> dict[str, object]:
    """Training facts stored beside the weights (steps, loss, seed, corpus)."""
    path = Path(path) if path is not None else default_weights_path()
    return dict(torch.load(path, map_location="cpu", weights_only=True)["meta"])
