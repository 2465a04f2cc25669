//! The hello fuzz target: byte strings (the seeds in `fuzz/hellos.corpus`, mutations of them,
//! random bytes) sent over a real loopback connection to `read_hello`, as a listener reads a
//! connecting peer. Whatever the bytes, it returns (a hello, a refusal with a reason, or an I/O
//! error) within its deadline without panicking, and a hello it accepts encodes back to the
//! bytes it read. `PROPTEST_CASES` sets the number of runs.

use super::handshake::{read_hello, HsFail};
use proptest::prelude::*;
use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn corpus() -> Vec<Vec<u8>> {
    include_str!("../../fuzz/hellos.corpus")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let hex = l.split_whitespace().next().unwrap();
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("corpus lines are hex")).collect()
        })
        .collect()
}

/// Sends `bytes` then closes the sending side; returns what `read_hello` made of them.
fn read_from(listener: &TcpListener, bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    client.write_all(bytes).unwrap();
    client.shutdown(Shutdown::Write).unwrap();
    let (mut server, _) = listener.accept().unwrap();
    let start = Instant::now();
    let got = read_hello(&mut server, start + Duration::from_secs(2));
    assert!(start.elapsed() < Duration::from_secs(3), "read_hello overran its deadline");
    match got {
        Ok(h) => Ok(h.encode()),
        Err(HsFail::Refuse(why)) | Err(HsFail::Io(why)) => Err(why),
    }
}

fn check(listener: &TcpListener, bytes: &[u8]) {
    if let Ok(encoded) = read_from(listener, bytes) {
        assert_eq!(&bytes[..encoded.len()], &encoded[..], "an accepted hello is exactly the bytes read");
    }
}

#[test]
fn every_corpus_hello_is_read_without_panic() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let seeds = corpus();
    assert!(read_from(&listener, &seeds[0]).is_ok(), "the first seed is a valid hello");
    for seed in &seeds {
        check(&listener, seed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn mutated_hellos_never_panic_or_overrun(
        pick in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in any::<prop::sample::Index>(),
        noise in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let seeds = corpus();
        let mut bytes = seeds[pick.index(seeds.len())].clone();
        if !bytes.is_empty() {
            for (at, b) in edits {
                let at = at.index(bytes.len());
                bytes[at] = b;
            }
        }
        bytes.truncate(bytes.len() - cut.index(bytes.len() / 3 + 1));
        bytes.extend_from_slice(&noise);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        check(&listener, &bytes);
    }
}
