//! Unit tests of the mesh's index arithmetic.

use super::{row_major_coord, row_major_index};

#[test]
fn row_major_round_trip() {
    let shape = [2, 3, 4];
    for i in 0..24 {
        let c = row_major_coord(i, &shape);
        assert_eq!(row_major_index(&c, &shape), i);
    }
    assert_eq!(&row_major_coord(23, &shape)[..], &[1, 2, 3]);
    assert_eq!(&row_major_coord(5, &shape)[..], &[0, 1, 1]);
}
