"""The package the two scripts share (issue #58): one copy of each shared part, and a front end that
imports no JAX, Keras or keras-hub, so that it can run in a process of its own."""
import ast
import subprocess
import sys

from conftest import REPO, script_env

FRONT_END = sorted("gemma_lora.frontend." + p.stem for p in (REPO / "gemma_lora" / "frontend").glob("*.py")
                   if p.stem != "__init__") + ["gemma_lora.interface", "gemma_lora.metrics"]


def test_the_front_end_imports_no_jax_keras_or_keras_hub():
    """Every front-end module, and the interface it talks to the engine through, imported in a fresh process:
    none of the model's libraries come with them."""
    check = ("import sys; " + "; ".join(f"import {m}" for m in FRONT_END) +
             "; print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'keras', 'keras_hub', "
             "'tensorflow'}))")
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True,
                            env=script_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_the_front_end_never_imports_the_engine_half():
    """The front end holds the engine only through the interface's methods (EngineCore): no module of it
    imports the engine's modules, which a process of its own would not have."""
    for module in FRONT_END:
        path = REPO / (module.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("gemma_lora.engine"), (module, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("gemma_lora.engine") for a in node.names), module


def test_both_scripts_use_the_package_s_one_copy_of_what_they_share():
    """What training and serving share lives once, in the package: the scripts define none of it themselves,
    and what they use is the package's own object (a chat rendered for training is the prompt served)."""
    import serve
    import train_local
    from gemma_lora import adapters, chat, memory, model, tokens
    shared = {chat: ("TEMPLATES", "ChatError", "parse_messages", "render_chat", "tools_prompt", "ToolRequest"),
              adapters: ("AdapterError", "LORA_MODULES", "DEFAULT_LORA_MODULES", "parse_lora_modules",
                         "keras_lora_scale", "lora_layer", "lora_kernel_shapes", "read_keras_adapter"),
              model: ("keep_unused_imports_out", "load_causal_lm", "explain_load_error", "layout_map_for"),
              tokens: ("make_text_codec",), memory: ("one_collection_after", "release_freed_memory")}
    for script in (train_local, serve):
        source = ast.parse((REPO / f"{script.__name__}.py").read_text())
        defined = {n.name for n in source.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.id for n in source.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        for module, names in shared.items():
            assert not defined & set(names), (script.__name__, defined & set(names))
    for module, names in shared.items():
        for name in names:
            assert getattr(train_local, name) is getattr(module, name), name
