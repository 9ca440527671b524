"""How every benchmark script reports: its table printed and, with --markdown FILE, written to
FILE for BENCHMARKS.md."""


def emit(text, markdown):
    """Prints `text` and writes it (ending in one newline) to `markdown` when given."""
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")


def table(lines, markdown):
    """Prints the table's lines and writes them to `markdown` when given."""
    emit("\n".join(lines), markdown)
