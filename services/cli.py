"""The `kvserve` command."""
def main() -> None:
    print("kvserve")
