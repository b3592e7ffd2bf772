//! The `gangway` binary: everything is in the library (`src/lib.rs`).

fn main() {
    gangway_cli::main()
}
