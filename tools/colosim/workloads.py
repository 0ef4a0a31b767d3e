"""Workload models: the training job types and inference services the simulator runs.

Training types are named after the job families Gavel measured (ResNet, Transformer, LSTM
LM, Recommendation, CycleGAN, A3C) plus LLM fine-tuning and a data-loader-bound vision job.
For each: ``sm`` is the SM activity alone on a whole GPU (also the knee of its shape: a
share at or above it runs at full speed), ``bw`` the memory-controller utilization alone,
``cpu`` the host CPU it needs (fraction of the cores pinned to its GPU), ``mem_gib`` the device memory
it declares, ``gamma`` how steeply it slows below its knee, ``growth`` how far memory grows
past the declaration at run time (1.0: not at all). The activities follow the published
pattern that single-GPU training jobs leave much of a modern GPU idle (ElastiCo: 25%
average utilization; MuxFlow: 26%) and that memory-bound jobs (recommendation embeddings,
LLM decoding) contend on bandwidth rather than SMs.

Inference services: ``mu`` requests/s at full GPU, ``sm``/``bw`` activity at full load,
memory = weights + a KV cache that grows with load, p99 SLO.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainType:
    name: str
    sm: float
    bw: float
    cpu: float
    mem_gib: float
    gamma: float = 0.85
    growth: float = 1.0


@dataclass(frozen=True)
class ServiceType:
    name: str
    mu: float
    sm: float
    bw: float
    weights_gib: float
    kv_gib: float
    slo_s: float
    cpu: float = 0.05


TRAIN_TYPES: dict[str, TrainType] = {
    t.name: t
    for t in (
        TrainType("resnet18", sm=0.35, bw=0.30, cpu=0.10, mem_gib=6),
        TrainType("resnet50", sm=0.75, bw=0.55, cpu=0.12, mem_gib=14),
        TrainType("transformer", sm=0.60, bw=0.50, cpu=0.04, mem_gib=12),
        TrainType("lstm-lm", sm=0.40, bw=0.35, cpu=0.03, mem_gib=8),
        TrainType("recommendation", sm=0.20, bw=0.65, cpu=0.10, mem_gib=20),
        TrainType("cyclegan", sm=0.55, bw=0.40, cpu=0.05, mem_gib=10),
        TrainType("a3c", sm=0.10, bw=0.05, cpu=0.30, mem_gib=3),
        TrainType("llm-finetune", sm=0.90, bw=0.80, cpu=0.04, mem_gib=48, growth=1.15),
        TrainType("bert-finetune", sm=0.50, bw=0.45, cpu=0.04, mem_gib=18),
        TrainType("vision-dataloader", sm=0.15, bw=0.10, cpu=0.25, mem_gib=8),
    )
}

SERVICE_TYPES: dict[str, ServiceType] = {
    s.name: s
    for s in (
        # A 7B chat model: decode is memory-bound; the KV cache follows the load.
        ServiceType("llm-chat", mu=40.0, sm=0.55, bw=0.75, weights_gib=16, kv_gib=30, slo_s=0.5),
        ServiceType(
            "resnet-serving", mu=1000.0, sm=0.50, bw=0.30, weights_gib=2, kv_gib=2, slo_s=0.02
        ),
        ServiceType(
            "bert-serving", mu=300.0, sm=0.60, bw=0.40, weights_gib=2, kv_gib=4, slo_s=0.05
        ),
    )
}

# Mixes: weights over TRAIN_TYPES. "uniform" is the calibration mix (every type alike, as
# Gavel's all-pairs measurements); "production" leans to the light, data-bound jobs that
# production traces are full of; "heavy" to the large models.
MIXES: dict[str, dict[str, float]] = {
    "uniform": dict.fromkeys(TRAIN_TYPES, 1.0),
    "production": {
        "resnet18": 2.0,
        "resnet50": 0.5,
        "transformer": 0.5,
        "lstm-lm": 2.0,
        "recommendation": 2.0,
        "cyclegan": 0.5,
        "a3c": 2.0,
        "llm-finetune": 0.3,
        "bert-finetune": 1.0,
        "vision-dataloader": 3.0,
    },
    "heavy": {
        "resnet50": 2.0,
        "transformer": 2.0,
        "llm-finetune": 1.0,
        "bert-finetune": 2.0,
        "cyclegan": 1.0,
        "resnet18": 1.0,
    },
}
