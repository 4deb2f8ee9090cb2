"""Writes generated Markdown between a pair of markers in a document (the result tables of the
lm example scripts are rendered into docs/ this way, from their JSON)."""


def write_between_markers(doc, tag, lines):
    """Replaces what lies between <!-- tag:begin --> and <!-- tag:end --> in `doc` with `lines`
    (appending the pair at the end when the document has none)."""
    with open(doc) as f:
        text = f.read()
    a, b = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    if a not in text:
        text += f"\n{a}\n{b}\n"
    head, rest = text.split(a, 1)
    with open(doc, "w") as f:
        f.write(head + a + "\n" + "\n".join(lines) + "\n" + b + rest.split(b, 1)[1])
