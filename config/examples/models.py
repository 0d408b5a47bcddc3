"""Transformer models for the example registration files, built from torch.nn alone
(no downloads, no transformers package): see config/examples/README.md.

    tools/lgreco-register --model config/examples/models.py:bert_base \\
        --input-shape 2,128 --input-dtype long --input-high 30522 -o bert_base.json

Both take token ids of shape (batch, sequence) and return logits over the vocabulary.
The parameter shapes are those of the reference models; the modules (and so the
parameter names) are torch.nn's.
"""

import torch
from torch import nn


class BertLike(nn.Module):
    """BERT-base as a masked language model: token, position and segment embeddings, an
    encoder of post-norm layers with GELU, the MLM head's transform, and a decoder whose
    weight is the token embedding (tied, as in BERT) plus its own bias."""

    def __init__(self, vocab=30522, d_model=768, heads=12, ff=3072, layers=12, max_len=512, type_vocab=2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.type_emb = nn.Embedding(type_vocab, d_model)
        self.emb_norm = nn.LayerNorm(d_model, eps=1e-12)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.mlm_dense = nn.Linear(d_model, d_model)
        self.mlm_norm = nn.LayerNorm(d_model, eps=1e-12)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        segments = torch.zeros_like(ids)
        x = self.tok_emb(ids) + self.pos_emb(positions) + self.type_emb(segments)
        x = self.encoder(self.emb_norm(x))
        x = self.mlm_norm(nn.functional.gelu(self.mlm_dense(x)))
        return nn.functional.linear(x, self.tok_emb.weight, self.mlm_bias)


class GPT2Like(nn.Module):
    """GPT-2 small: token and position embeddings, pre-norm causal layers with GELU, a final
    LayerNorm and an LM head tied to the token embedding (no bias)."""

    def __init__(self, vocab=50257, d_model=768, heads=12, ff=3072, layers=12, max_len=1024):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(d_model)

    def forward(self, ids):
        n = ids.shape[1]
        positions = torch.arange(n, device=ids.device)
        causal = torch.triu(torch.full((n, n), float("-inf"), device=ids.device), diagonal=1)
        x = self.blocks(self.tok_emb(ids) + self.pos_emb(positions), mask=causal)
        return nn.functional.linear(self.final_norm(x), self.tok_emb.weight)


def bert_base(**kwargs):
    return BertLike(**kwargs)


def gpt2_small(**kwargs):
    return GPT2Like(**kwargs)
