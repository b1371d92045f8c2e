"""Writes host-compilable copies of cuda/*.cu, *.cuh, *.h into an output directory.

The copies differ from the originals only where the host cannot follow:
mma.cuh, wgmma.cuh, mbarrier.cuh, dependent_launch.cuh and host_wait.cuh become their emulator stand-ins, each kernel<<<grid, block, smem, stream>>>(args)
becomes emu::launch(grid, block, smem, [&] { kernel(args); }), and shared
arrays become the emulator's (dynamic) or function statics (static).
"""

import pathlib
import re
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
STAND_INS = {"mma.cuh": "mma_emu.cuh", "wgmma.cuh": "wgmma_emu.cuh", "mbarrier.cuh": "mbarrier_emu.cuh",
             "dependent_launch.cuh": "dependent_launch_emu.cuh", "host_wait.cuh": "host_wait_emu.cuh"}
LAUNCH = re.compile(r"(\b[\w:]+(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\((.*?)\);", re.DOTALL)


def split_top_level(text):
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "<(["
        depth -= ch in ">)]"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return parts + [current.strip()]


def to_emulated_launch(match):
    kernel, config, args = match.groups()
    grid, block, shared_bytes, _stream = split_top_level(config)
    return (f"emu::launch(dim3({grid}), dim3({block}), static_cast<size_t>({shared_bytes}), "
            f"[&] {{ {kernel}({args}); }});")


def main(out_dir):
    src = HERE.parent
    out = pathlib.Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in sorted([*src.glob("*.cu"), *src.glob("*.cuh"), *src.glob("*.h")]):
        text = (HERE / STAND_INS[path.name]).read_text() if path.name in STAND_INS else path.read_text()
        text = LAUNCH.sub(to_emulated_launch, text)
        text = text.replace("extern __shared__ __align__(16) unsigned char shared_bytes[];",
                            "unsigned char* shared_bytes = emu_smem;")
        text = re.sub(r"__shared__ (\w+) ", r"static \1 ", text)  # CTAs run one at a time
        if re.search(r">>>\s*\(", text) or re.search(r"^[^/]*__shared__", text, re.MULTILINE):
            sys.exit(f"{path.name}: a launch or shared array the emulator cannot translate")
        (out / (path.stem + ".cc" if path.suffix == ".cu" else path.name)).write_text(text)


if __name__ == "__main__":
    main(sys.argv[1])
