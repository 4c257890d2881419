"""Prompts for the tools that send many: the built-in set, and reading a file of them.

`gateeng calibrate` decodes them on a local engine; `gateeng probe` sends them to a
server. The built-in prompts are everyday chat requests of varied length and topic.
"""
from __future__ import annotations

import json
from pathlib import Path

BUILTIN_PROMPTS = [
    "Explain how a refrigerator works.", "Write a short poem about autumn leaves.",
    "What are three benefits of learning a second language?", "Describe a day in the life of a blacksmith.",
    "Summarize the plot of Romeo and Juliet in two sentences.", "How do vaccines train the immune system?",
    "Give me a recipe for a simple tomato soup.", "Why is the sky blue?",
    "Write a Python function that reverses a string.", "What is the difference between weather and climate?",
    "List five animals that live in the desert.", "Explain recursion to a ten-year-old.",
    "Tell a story about a dragon who learns to paint.", "What causes the seasons on Earth?",
    "How does a bill become a law in the United States?", "Describe the taste of a lemon.",
    "What should I pack for a weekend camping trip?", "Explain what a black hole is.",
    "Write a haiku about the ocean.", "How do plants make food from sunlight?",
    "Give three tips for a job interview.", "What is the capital of Australia and why was it chosen?",
    "Describe how to tie a shoelace.", "Explain the rules of chess briefly.",
    "Why do cats purr?", "Write a thank-you note to a teacher.",
    "What is machine learning?", "How do airplanes stay in the air?",
    "Compare coffee and tea in a short paragraph.", "What were the causes of the French Revolution?",
    "Invent a name and a slogan for a bakery.", "How does the internet send a message from one computer to another?",
]


def read_prompts(path: Path) -> list:
    """Text lines, or JSONL with a `prompt` field per line; blank lines are skipped."""
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: a JSON line needs a string `prompt` field ({exc})") from None
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
