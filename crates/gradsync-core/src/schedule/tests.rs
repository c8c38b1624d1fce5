use super::*;

#[test]
fn deps_and_fifo_order() {
    let mut p = Program::new();
    let l = |s| Loc::new(Buf::Output, s);
    let r0 = p.push(Op::Recv { peer: 1, dst: l(0), reduce_with: None, len: 1 }, &[]);
    let s0 = p.push(Op::Send { peer: 1, src: l(0), len: 1 }, &[r0]);
    let s1 = p.push(Op::Send { peer: 1, src: l(1), len: 1 }, &[]);
    let mut s = Schedule::new(p, 2);
    // s1 has no deps but must wait behind s0 in the send queue to peer 1.
    assert_eq!(s.poll_action().map(|x| x.0), Some(r0));
    assert_eq!(s.poll_action(), None);
    s.handle_complete(r0);
    assert_eq!(s.poll_action().map(|x| x.0), Some(s0));
    assert_eq!(s.poll_action().map(|x| x.0), Some(s1));
    s.handle_complete(s1);
    assert!(!s.is_done());
    s.handle_complete(s0);
    assert!(s.is_done());
}
