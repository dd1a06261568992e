"""The torch modules of digits-cnn and digits-vit (:mod:`quantlab.zoo.digits` holds their
data, which reads without torch)."""

from __future__ import annotations

import torch
from torch import nn

from quantlab.zoo.digits import INPUT_SHAPE, NUM_CLASSES


class ResidualBlock(nn.Module):
    """Two 3x3 Conv+BN with an identity shortcut (ResNet basic block)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(x + self.bn2(self.conv2(y)))


class DigitsCNN(nn.Module):
    """Conv+BN+ReLU stem, residual block, max-pool, conv, global average pool, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                                  nn.ReLU(inplace=True))
        self.block = ResidualBlock(32)
        self.pool = nn.MaxPool2d(2)
        self.conv = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True))
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.2)
        self.classifier = nn.Linear(64, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.pool(self.block(self.stem(x))))
        return self.classifier(self.dropout(torch.flatten(self.gap(x), 1)))


class SelfAttention(nn.Module):
    """Multi-head self-attention from Linear q/k/v, MatMul and Softmax (exports as plain ops)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        return x.reshape(n, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        attention = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.head_dim**-0.5, -1)
        out = torch.matmul(attention, v).transpose(1, 2)
        return self.proj(out.reshape(x.shape[0], x.shape[1], -1))


class EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer: LayerNorm, attention, LayerNorm, GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(),
                                 nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DigitsViT(nn.Module):
    """ViT: 2x2 patch embedding (strided Conv), class token, position embedding, 3 layers."""

    def __init__(self, dim: int = 64, heads: int = 4, depth: int = 3, patch: int = 2) -> None:
        super().__init__()
        tokens = (INPUT_SHAPE[1] // patch) * (INPUT_SHAPE[2] // patch)
        self.patch_embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.layers = nn.Sequential(*(EncoderLayer(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = self.layers(torch.cat([cls, tokens], 1) + self.pos_embed)
        return self.head(self.norm(x[:, 0]))


MODELS: dict[str, type[nn.Module]] = {"digits-cnn": DigitsCNN, "digits-vit": DigitsViT}
