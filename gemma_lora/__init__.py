"""What train_local.py and serve.py share, and serving's two halves.

Shared by both scripts: chat.py (prompt templates, chat and tool-prompt rendering), adapters.py (LoRA
adapters and their PEFT mapping), model.py (loading a preset or a transformers-layout dir), tokens.py
(the tokenizer without TensorFlow), memory.py (RSS and giving freed memory back).

Serving: engine/ owns the model (its compiled programs, the warm-up, the decode batch, the worker);
frontend/ speaks HTTP and the OpenAI API and never imports JAX, Keras or keras-hub. They meet in
interface.py: a Generation goes in, its events come out. metrics.py is read and written by both.
"""
import os


os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras
