//! Parses a pickle file and prints how long it took and how many containers it holds.
#![allow(clippy::print_stdout)]
fn main() {
    for path in std::env::args().skip(1) {
        let src = oomkit_pickle::Source::open(path.as_ref()).expect("open");
        let t = std::time::Instant::now();
        match oomkit_pickle::Document::parse(src.bytes()) {
            Ok(doc) => println!(
                "{path}: {} containers in {:?}",
                doc.container_count(),
                t.elapsed()
            ),
            Err(e) => println!("{path}: {e}"),
        }
    }
}
