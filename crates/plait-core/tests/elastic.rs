//! Elastic mode end to end, in one process: members on threads found a group, admit joiners at
//! update points, lose a member mid-loop and go on; every result that a member returns is checked
//! against the sum over the members that took part.

use plait_core::{CollRequest, CommConfig, DType, ElasticComm, ElasticConfig, PlaitError, RawBuf, ReduceOp, Token};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn config(group: &str, peers: Vec<String>) -> ElasticConfig {
    let mut comm = CommConfig::from_env(0, 1).unwrap();
    comm.group = group.into();
    comm.timeout = Duration::from_secs(20);
    comm.token = Some(Token::new(b"elastic test".to_vec()));
    comm.heartbeat_timeout = Duration::from_millis(500);
    ElasticConfig { listen: "127.0.0.1:0".into(), peers, dial_timeout: None, witness: None, comm }
}

fn allreduce(c: &ElasticComm, data: &mut [f64]) -> Result<(), PlaitError> {
    let buf = RawBuf { ptr: data.as_mut_ptr() as *mut u8, len: std::mem::size_of_val(data) };
    let req = CollRequest::allreduce(buf, DType::F64, ReduceOp::Sum);
    // SAFETY: `data` outlives the call and nothing else touches it.
    unsafe { c.collective(req) }
}

/// Each member's input: a function of its id, the epoch and the step, so the expected sum is
/// known from the view.
fn input(id: u64, epoch: u64, step: u64, n: usize) -> Vec<f64> {
    (0..n).map(|i| ((id % 1000) as f64) + (epoch * 100 + step) as f64 + i as f64 * 0.5).collect()
}

/// Runs `steps` allreduces with retry; checks every returned result against the view it ran in.
fn run_loop(c: &ElasticComm, steps: u64, n: usize) -> (u64, u64) {
    let (mut ok, mut lost) = (0, 0);
    let mut step = 0;
    while step < steps {
        let view = c.view();
        let mut data = input(c.member_id(), view.epoch, step, n);
        let before = data.clone();
        match allreduce(c, &mut data) {
            Ok(()) => {
                let expected: Vec<f64> = (0..n).map(|i| view.members.iter().map(|&m| input(m, view.epoch, step, n)[i]).sum()).collect();
                assert_eq!(data, expected, "step {step}, epoch {}: a wrong result", view.epoch);
                ok += 1;
                step += 1;
            }
            Err(PlaitError::PeerLost { .. }) => {
                assert_eq!(data, before, "a failed operation must leave the buffer as it was");
                lost += 1;
            }
            Err(e) => panic!("member {:x}: {e}", c.member_id()),
        }
    }
    (ok, lost)
}

#[test]
fn members_join_at_update_points_and_go_on_without_one_that_leaves_mid_loop() {
    let founder = Arc::new(ElasticComm::start(config("t1", vec![])).unwrap());
    let contact = founder.contact();
    let joined = Arc::new(Barrier::new(4));
    let mut handles = Vec::new();
    for j in 0..3 {
        let contact = contact.clone();
        let joined = joined.clone();
        handles.push(std::thread::spawn(move || {
            let c = ElasticComm::start(config("t1", vec![contact])).unwrap();
            // The update point that admitted it is the members' current one.
            assert!(c.update().unwrap());
            while c.view().members.len() < 4 {
                c.update().unwrap();
            }
            joined.wait();
            if j == 2 {
                // Leaves mid-loop, while the others are in the middle of their operations.
                let _ = run_loop(&c, 3, 1001);
                c.close();
                return (0, 0);
            }
            run_loop(&c, 20, 1001)
        }));
    }
    let start = Instant::now();
    while founder.view().members.len() < 4 {
        assert!(start.elapsed() < Duration::from_secs(20), "joiners not admitted");
        founder.update().unwrap();
    }
    joined.wait();
    let (ok, _) = run_loop(&founder, 20, 1001);
    assert_eq!(ok, 20);
    let mut lost = 0;
    for h in handles {
        let (ok, l) = h.join().unwrap();
        assert!(ok == 0 || ok == 20);
        lost += l;
    }
    eprintln!("founder epoch {}, survivors' lost operations: {lost}", founder.view().epoch);
    assert!(lost >= 2, "the member that left mid-loop failed an operation on both other joiners");
    // Every joiner left when its thread ended (a leaving member votes for the view without it,
    // so the group shrinks to one without a majority problem).
    let start = Instant::now();
    while founder.view().members.len() > 1 {
        assert!(start.elapsed() < Duration::from_secs(10), "members that left are still in the view");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_join_keeps_the_members_links_and_makes_new_ones_to_the_joiner_only() {
    let founder = Arc::new(ElasticComm::start(config("t-grow", vec![])).unwrap());
    let contact = founder.contact();
    // The first joiner runs a step with the founder alone, then (as the second joiner) 9 steps
    // once all three are in.
    let member = |c: &ElasticComm, first: usize| {
        while c.view().members.len() < first {
            c.update().unwrap();
        }
        let (mut ok, mut lost) = if first == 2 { run_loop(c, 1, 257) } else { (0, 0) };
        while c.view().members.len() < 3 {
            c.update().unwrap();
        }
        let (o, l) = run_loop(c, 9, 257);
        ok += o;
        lost += l;
        (ok, lost, c.routes())
    };
    let spawn_joiner = |first: usize| {
        let contact = contact.clone();
        std::thread::spawn(move || {
            let c = ElasticComm::start(config("t-grow", vec![contact])).unwrap();
            assert!(c.update().unwrap());
            let out = member(&c, first);
            c.close();
            out
        })
    };
    let first = spawn_joiner(2);
    while founder.view().members.len() < 2 {
        founder.update().unwrap();
    }
    let mut ok = run_loop(&founder, 1, 257).0;
    let second = spawn_joiner(3);
    while founder.view().members.len() < 3 {
        founder.update().unwrap();
    }
    let (o, lost) = run_loop(&founder, 9, 257);
    ok += o;
    assert_eq!((ok, lost), (10, 0), "a join fails no operation");
    let routes = founder.routes();
    let to = |peer: usize| routes.iter().find(|r| r.peer == peer).map(|r| r.reason.clone()).unwrap_or_default();
    assert!(to(1).contains("kept from epoch"), "the founder's link to the first joiner carries on: {routes:?}");
    assert!(!to(2).contains("kept"), "the link to the new joiner is new: {routes:?}");
    let (ok1, lost1, routes1) = first.join().unwrap();
    let (ok2, lost2, _) = second.join().unwrap();
    assert_eq!((ok1, lost1, ok2, lost2), (10, 0, 9, 0));
    assert!(routes1.iter().any(|r| r.peer == 0 && r.reason.contains("kept from epoch")), "{routes1:?}");
}
