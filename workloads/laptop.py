"""The laptop mix: a foreground chat session and background ingestion of documents."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DOC_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class ChatScript:
    system: str
    turns: list[str]
    think_time_s: float
    max_tokens: int


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def load_chat_script(path: str | Path | None = None) -> ChatScript:
    if path is None:
        text = (resources.files("dlfp.workloads") / "data" / "chat_script.json").read_text()
    else:
        text = Path(path).read_text()
    data = json.loads(text)
    return ChatScript(data["system"], list(data["turns"]), float(data["think_time_s"]), int(data["max_tokens"]))


def load_documents(folder: str | Path | None = None) -> list[Document]:
    """Every .txt/.md file in `folder` (the bundled sample corpus by default), by name."""
    if folder is None:
        root = resources.files("dlfp.workloads") / "data" / "docs"
        files = [f for f in root.iterdir() if f.name.endswith(DOC_SUFFIXES)]
    else:
        root = Path(folder)
        if not root.is_dir():
            raise ValueError(f"--docs: not a folder: {root}")
        files = [f for f in root.iterdir() if f.name.endswith(DOC_SUFFIXES)]
    docs = [Document(f.name, f.read_text()) for f in sorted(files, key=lambda f: f.name)]
    if not docs:
        raise ValueError(f"no .txt or .md documents in {root}")
    return docs


def summary_messages(doc: Document) -> list[dict]:
    return [{"role": "user", "content": f"Summarise this document in one sentence.\n\n{doc.text.strip()}"}]


def chat_messages(script: ChatScript, history: list[tuple[str, str]], user: str) -> list[dict]:
    messages = [{"role": "system", "content": script.system}]
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": user}]
