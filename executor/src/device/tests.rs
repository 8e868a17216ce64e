//! The host device's kernels at their edges: whole rows, axis swaps, biases.

use super::*;

#[test]
fn rows_of_counts_whole_rows_and_names_a_ragged_buffer() {
    assert_eq!(rows_of("y", 12, 4), Ok(3));
    assert_eq!(rows_of("y", 0, 0), Ok(0));
    let e = rows_of("dy", 10, 4).unwrap_err();
    assert_eq!(e.0, "dy: 10 values are not whole rows of 4");
    assert!(rows_of("x", 3, 0).is_err());
}

/// `[b=2, s=3, w=1]` (hand-worked): sample 0 holds 0 1 2, sample 1 holds 3 4 5;
/// by position they read 0 3 | 1 4 | 2 5, and `[s, b, w]` swaps them back.
#[test]
fn swap_axes_is_its_own_inverse_with_the_axes_named_the_other_way() {
    let x: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let mut t = vec![0.0; 6];
    HostDevice.swap_axes(&x, [2, 3, 1], &mut t).unwrap();
    assert_eq!(t, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    let mut back = vec![0.0; 6];
    HostDevice.swap_axes(&t, [3, 2, 1], &mut back).unwrap();
    assert_eq!(back, x);
}

/// Two rows of width 3 plus bias `[1, 2, 3]`, and the bias gradient of rows
/// `[1, 1, 1]` and `[2, 0, -1]`: `[3, 1, 0]`.
#[test]
fn bias_kernels_take_the_width_from_the_bias() {
    let mut y = vec![0.0, 0.0, 0.0, 10.0, 10.0, 10.0];
    HostDevice.bias_add(&mut y, &vec![1.0, 2.0, 3.0]).unwrap();
    assert_eq!(y, vec![1.0, 2.0, 3.0, 11.0, 12.0, 13.0]);
    let mut db = vec![0.0; 3];
    HostDevice
        .bias_grad(&vec![1.0, 1.0, 1.0, 2.0, 0.0, -1.0], &mut db)
        .unwrap();
    assert_eq!(db, vec![3.0, 1.0, 0.0]);
    assert!(HostDevice
        .bias_add(&mut vec![0.0; 5], &vec![1.0; 3])
        .is_err());
}

#[test]
fn f32_concat_lays_the_runs_end_to_end_and_names_a_run_out_of_range() {
    let (x, y) = (vec![1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0]);
    let got = HostDevice.f32_concat(&[(&x, 1, 2), (&y, 0, 2), (&x, 0, 0), (&x, 3, 1)]);
    assert_eq!(got.unwrap(), [2.0, 3.0, 5.0, 6.0, 4.0]);
    assert_eq!(HostDevice.f32_concat(&[]).unwrap(), Vec::<f32>::new());
    let e = HostDevice.f32_concat(&[(&y, 1, 2)]).unwrap_err();
    assert!(e.0.contains("f32_concat source"), "{e:?}");
}
