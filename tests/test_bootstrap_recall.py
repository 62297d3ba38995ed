"""Recall pretraining (bootstrap stage 4b): its synthetic targets are exactly what the policy later writes — a
summary's ``codes found:`` list and the expert's answer tool call — listing every code of the context in order."""

from __future__ import annotations

import re

import torch

from compactionrl.bootstrap import SFTConfig, recall_pretraining
from compactionrl.models.tiny import build_tiny_model, train_tokenizer
from compactionrl.rollout.protocol import parse_action
from compactionrl.tasks.expert import VisibleState, expert_action, expert_corpus
from compactionrl.tasks.suite import SuiteConfig, generate_task


class _Recorder(torch.nn.Module):
    """Stands in for the model: records each batch, returns a differentiable zero loss."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.batches = []

    def forward(self, input_ids, attention_mask, labels):
        self.batches.append((input_ids.clone(), attention_mask.clone(), labels.clone()))
        return type("Out", (), {"loss": self.w.sum() * 0})()


def _tokenizer():
    tasks = [generate_task(7, i, SuiteConfig(n_pages=4, n_facts=2, value_style="word")) for i in range(20)]
    return train_tokenizer(expert_corpus(tasks), vocab_size=600, word_boundaries="letters")


def test_targets_list_every_code_in_order_as_summary_or_answer():
    tok = _tokenizer()
    rec = _Recorder()
    recall_pretraining(rec, tok, "builtin:value_style=word", SFTConfig(pretrain_steps=4, pretrain_batch=16), seed=3,
                       progress=False)  # fmt: skip
    kinds = set()
    for ids, attn, labels in rec.batches:
        for i in range(ids.shape[0]):
            n = int(attn[i].sum())
            start = int((labels[i, :n] != -100).nonzero()[0])
            assert torch.equal(labels[i, start:n], ids[i, start:n]) and bool((labels[i, :start] == -100).all())
            assert bool((labels[i, n:] == -100).all())  # no loss on padding
            context, target = tok.decode(ids[i, :start]), tok.decode(ids[i, start:n])
            carried = re.findall(r"^codes found: (.*)$", context, re.M)
            expected = (carried[0].split() if carried else []) + [
                f"{a}={b}" for a, b in re.findall(r"^code (\w+)=(\w+)$", context, re.M)
            ]
            assert expected
            if target.startswith("codes found: "):
                kinds.add("summary")
                assert target == "codes found: " + " ".join(expected) + "\n"
            else:
                kinds.add("answer")
                action = parse_action(target)  # the action protocol reads it as the answer command
                state = VisibleState(codes=dict(p.split("=") for p in expected), finished_reading=True)
                assert target == expert_action(state), (target, expected)
                assert action.command.startswith("printf")
    assert kinds == {"summary", "answer"}


def test_recall_pretraining_lowers_the_loss_of_a_real_model():
    tok = _tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                             max_position_embeddings=512, seed=0)  # fmt: skip
    cfg = SFTConfig(pretrain_steps=30, pretrain_batch=8, pretrain_lr=3e-3)
    losses = recall_pretraining(model, tok, "builtin:value_style=word", cfg, seed=0, progress=False)
    assert len(losses) == 30 and all(x == x for x in losses)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
