"""
Files: what the project writes is whole or absent (write_atomic: a crash between two writes
leaves the old file or the new one, never half of one), and a file a user could have
damaged or cut short stops the reader with one line that names the file and the fix
(InputError), not a traceback. model.py's load() and save() and every script use these.
"""
import json
import os


class InputError(ValueError):
    """A mistake in what the user passed, not in the code: its message names the problem and
    the fix, and a script ends with that one line instead of a traceback (cli.run_script)."""


def read_json(path):
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not valid JSON ({e}); the file is damaged: restore it "
                             f"or write it again") from None


def read_safetensors_file(path, device="cpu"):
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path, device=str(device))
    except SafetensorError as e:
        raise InputError(f"{path} is not a readable safetensors file ({e}); download it or write "
                         f"it again") from None


def write_atomic(path, write):
    """write(temporary path), then rename: a crash never leaves a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, obj):
    write_atomic(path, lambda p: open(p, "w").write(json.dumps(obj, indent=2) + "\n"))
